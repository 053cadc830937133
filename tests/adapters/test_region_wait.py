"""A load waiting for host memory (every pool region held) is woken by a change that may free
some, not by a timer: the waiters scan the CPU tier for a victim once per change together, and
the one released region goes to one of them."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.adapters import region_wait
from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.region_wait import RegionWaiter

pytestmark = pytest.mark.timeout(60)


async def test_waiting_loads_look_again_only_when_told(monkeypatch):
    monkeypatch.setattr(region_wait, "ROOM_POLL_S", 60.0)  # no safety-net pass within the test
    pool = HostPool(4096, 1)
    waiter = RegionWaiter(pool)
    scans: list[int] = []

    def make_room() -> bool:  # the registry's, with no idle version to evict
        scans.append(1)
        return False

    waiter.make_room = make_room
    held = pool.acquire()
    assert held is not None
    waiters = [asyncio.create_task(waiter.acquire()) for _ in range(3)]
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert len(scans) == 1  # the first waiter found no victim; the others knew it
    assert not any(t.done() for t in waiters)

    waiter.room_changed()  # e.g. a request ended: its adapter may be evictable now
    for _ in range(5):
        await asyncio.sleep(0.01)
    assert len(scans) == 2  # one scan for the three waiters woken together
    assert not any(t.done() for t in waiters)

    pool.release(held)  # the registry unloads a version: its region goes back, and it says so
    waiter.room_changed()
    done, pending = await asyncio.wait(waiters, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and done.pop().result().index == held.index
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    pool.close()


async def test_a_waiting_load_takes_the_region_an_eviction_frees():
    pool = HostPool(4096, 1)
    waiter = RegionWaiter(pool)
    held = pool.acquire()
    assert held is not None
    victims = [held]

    def make_room() -> bool:  # the registry's: unload one idle version (its region back)
        if not victims:
            return False
        pool.release(victims.pop())
        waiter.room_changed()
        return True

    waiter.make_room = make_room
    region = await asyncio.wait_for(waiter.acquire(), 10)
    assert region.index == held.index and not victims
    pool.close()


async def test_a_load_records_how_long_it_waited_for_host_memory():
    """The wait is the load's ``host_wait`` timing: the cold-load study tells loads that wait
    for slot turnover (every region held by adapters with queued requests) from a slow load
    path by it."""
    from loraplex.engine.adapters.staging import AdapterStager
    from loraplex.engine.adapters.version import AdapterVersion

    pool = HostPool(4096, 1)
    stager = AdapterStager(None, None, pool)  # type: ignore[arg-type]  # (only its waiter)
    held = pool.acquire()
    v = AdapterVersion("a", "local:///a", "", 1)
    task = asyncio.create_task(stager._acquire(v))
    await asyncio.sleep(0.05)
    assert not task.done()
    pool.release(held)
    stager.regions.room_changed()
    region = await asyncio.wait_for(task, 10)
    assert region.index == held.index and v.timings["host_wait"] >= 0.04
    pool.close()
