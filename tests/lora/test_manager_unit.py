"""AdapterManager on its own: a fake loader, no model, no engine.

Covers single-flight loads, user and slot reference counts, the CPU tier (LRU over idle
versions), GPU slot assignment and eviction, and failed / cancelled loads.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from loraplex.engine.lora.errors import AdapterNotFoundError
from loraplex.engine.lora.manager import (
    AdapterManager,
    AdapterState,
    AdapterVersion,
    SlotFullError,
)


class FakeLoader:
    """The manager's async loader: each call waits until the test ends it (``finish``)."""

    def __init__(self) -> None:
        self.calls: list[AdapterVersion] = []
        self._gates: dict[int, asyncio.Future] = {}

    async def __call__(self, v: AdapterVersion) -> None:
        self.calls.append(v)
        gate = asyncio.get_running_loop().create_future()
        self._gates[id(v)] = gate
        await gate  # raises the error ``finish`` set
        v.adapter = SimpleNamespace(rank=4, nbytes=1000)

    async def finish(self, v: AdapterVersion, error: BaseException | None = None) -> None:
        """End ``v``'s running load (with ``error``: it fails) and let the manager see it."""
        task = v.load_task
        assert task is not None, f"no load of {v.key} runs"
        await asyncio.sleep(0)  # the task reaches the loader
        gate = self._gates.pop(id(v))
        if error is None:
            gate.set_result(None)
        else:
            gate.set_exception(error)
        await settle(task)


async def settle(task: asyncio.Task) -> None:
    """Let ``task`` end (bounded: a bug that keeps it running fails the test, not hangs it)."""
    await asyncio.wait([task], timeout=5.0)
    assert task.done(), "the load task is still running"


def make_manager(max_loras: int = 2, max_cpu_loras: int = 3, **kw) -> AdapterManager:
    kw.setdefault("loader", FakeLoader())
    return AdapterManager(max_loras=max_loras, max_cpu_loras=max_cpu_loras, **kw)


def register(m: AdapterManager, name: str, digest: str | None = None, **kw) -> AdapterVersion:
    v = m.new_version(name, f"file:///adapters/{name}", **kw)
    v.digest = digest or f"sha-{name}"
    return m.register(v)


def loaded(m: AdapterManager, name: str, *, last_used: float = 0.0, **kw) -> AdapterVersion:
    """A registered version already in the CPU tier (as a finished load leaves it)."""
    v = register(m, name, **kw)
    v.state = AdapterState.CPU
    v.adapter = SimpleNamespace(rank=4, nbytes=1000)
    v.last_used = last_used
    return v


def in_slot(m: AdapterManager, name: str, *, last_used: float = 0.0, **kw) -> AdapterVersion:
    """A CPU-tier version whose slot write has landed (what the engine's poll does)."""
    v = loaded(m, name, **kw)
    assert m.assign_slot(v) is not None
    v.slot_ready = True
    v.last_used = last_used  # assign_slot touched it
    return v


# -- single flight ------------------------------------------------------------------------------


async def test_one_load_per_version_shared_by_its_users():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register(m, "sql")
    assert m.add_user(v) == "cold"
    assert m.add_user(v) == "cold"
    m.ensure_loaded(v)
    await asyncio.sleep(0)
    assert loader.calls == [v] and v.state is AdapterState.LOADING
    assert m.stats["loads"] == 1 and m.stats["misses"] == 2
    await loader.finish(v)
    assert v.state is AdapterState.CPU and v.adapter is not None and v.load_task is None
    assert v.users == 2
    m.ensure_loaded(v)  # loaded: nothing to do
    assert m.add_user(v) == "cpu"  # in the CPU tier, no slot yet
    assert loader.calls == [v] and m.stats["loads"] == 1 and m.stats["cpu_hits"] == 1


async def test_each_version_loads_on_its_own():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    old = register(m, "sql", "d1")
    m.add_user(old)
    new = register(m, "sql", "d2")  # new content under the same name: a new version
    assert new is not old and m.get("sql") is new
    m.add_user(new)
    await asyncio.sleep(0)
    assert loader.calls == [old, new] and m.stats["loads"] == 2
    await loader.finish(new)
    assert new.state is AdapterState.CPU and old.state is AdapterState.LOADING
    await loader.finish(old)
    assert old.state is AdapterState.CPU


async def test_on_change_is_called_when_a_load_ends_either_way():
    loader, changes = FakeLoader(), []
    m = make_manager(loader=loader, on_change=lambda: changes.append(1))
    a, b = register(m, "a"), register(m, "b")
    m.add_user(a)
    m.add_user(b)
    await loader.finish(a)
    assert len(changes) == 1
    await loader.finish(b, RuntimeError("boom"))
    assert len(changes) == 2


# -- references ---------------------------------------------------------------------------------


async def test_user_count_back_to_zero_after_requests_end():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register(m, "sql")
    m.add_user(v)
    m.add_user(v)
    await loader.finish(v)
    m.drop_user(v)
    m.drop_user(v)
    assert v.users == 0 and v.state is AdapterState.CPU  # stays cached for the next request
    with pytest.raises(AssertionError):
        m.drop_user(v)


def test_slot_refs_back_to_zero_and_never_negative():
    m = make_manager()
    v = in_slot(m, "sql")
    m.acquire_slot(v)
    m.acquire_slot(v)
    assert v.slot_refs == 2 and v.last_used > 0.0  # a reader touches it (LRU)
    m.release_slot(v)
    m.release_slot(v)
    assert v.slot_refs == 0
    with pytest.raises(AssertionError):
        m.release_slot(v)


def test_acquire_needs_the_slot_it_owns():
    m = make_manager()
    v, w = loaded(m, "sql"), loaded(m, "poem")
    with pytest.raises(AssertionError):
        m.acquire_slot(v)  # no slot
    m.assign_slot(v)
    w.slot = v.slot  # a stale slot number: the slot belongs to v
    with pytest.raises(AssertionError):
        m.acquire_slot(w)
    assert v.slot_refs == w.slot_refs == 0
    m.acquire_slot(v)  # before its write landed: a request joining the write's step
    assert v.slot_refs == 1 and not v.slot_ready


async def test_last_user_leaving_cancels_the_load():
    loader, unloaded = FakeLoader(), []
    m = make_manager(loader=loader, on_unload=unloaded.append)
    v = register(m, "sql")
    m.add_user(v)
    m.add_user(v)
    await asyncio.sleep(0)
    task = v.load_task
    m.drop_user(v)
    assert not task.cancelled() and v.state is AdapterState.LOADING  # one user still waits
    m.drop_user(v)
    await settle(task)
    assert task.cancelled()
    assert v.state is AdapterState.REGISTERED and v.adapter is None and v.load_task is None
    assert unloaded == [v] and v.users == 0 and m.get("sql") is v  # a static name stays
    m.add_user(v)  # a later request loads it again
    await asyncio.sleep(0)
    assert v.state is AdapterState.LOADING and len(loader.calls) == 2
    await loader.finish(v)
    assert v.state is AdapterState.CPU


async def test_last_user_leaving_before_the_load_ran():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register(m, "sql")
    m.add_user(v)
    task = v.load_task
    m.drop_user(v)  # e.g. the request aborted before the loop ran the load task once
    await settle(task)
    assert task.cancelled() and loader.calls == []
    assert v.state is AdapterState.REGISTERED and v.load_task is None
    m.add_user(v)  # a later request loads it again
    assert v.state is AdapterState.LOADING and v.load_task is not None
    await asyncio.sleep(0)
    assert loader.calls == [v]
    await loader.finish(v)
    assert v.state is AdapterState.CPU


async def test_cancelled_dynamic_version_is_forgotten():
    loader, dropped = FakeLoader(), []
    m = make_manager(loader=loader, on_drop=dropped.append)
    v = register(m, "made-up", dynamic=True)
    m.add_user(v)
    await asyncio.sleep(0)
    task = v.load_task
    m.drop_user(v)
    await settle(task)
    assert "made-up" not in m.names() and v not in m.versions() and dropped == [v]


# -- failed loads -------------------------------------------------------------------------------


async def test_failed_load_fails_only_that_version():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    bad, good = register(m, "bad"), register(m, "good")
    m.add_user(bad)
    m.add_user(bad)
    m.add_user(good)
    error = ValueError("corrupt safetensors")
    await loader.finish(bad, error)
    await loader.finish(good)
    assert bad.state is AdapterState.FAILED and bad.error is error and bad.adapter is None
    assert good.state is AdapterState.CPU and good.error is None
    assert m.stats["load_failures"] == 1 and bad.users == 2 and good.users == 1


async def test_reset_failed_allows_a_retry():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register(m, "sql")
    m.add_user(v)
    await loader.finish(v, OSError("unreachable"))
    m.drop_user(v)  # its waiter was failed
    assert v.users == 0 and v.state is AdapterState.FAILED
    m.reset_failed(v)
    assert v.state is AdapterState.REGISTERED and m.get("sql") is v
    m.add_user(v)
    await loader.finish(v)
    assert v.state is AdapterState.CPU and v.error is None and len(loader.calls) == 2


async def test_reset_failed_forgets_a_dynamic_version():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register(m, "made-up", dynamic=True)
    m.add_user(v)
    await loader.finish(v, OSError("404"))
    m.drop_user(v)
    m.reset_failed(v)
    with pytest.raises(AdapterNotFoundError):
        m.get("made-up")
    assert v not in m.versions()


# -- CPU tier -----------------------------------------------------------------------------------


async def test_cpu_tier_evicts_the_least_recently_used_idle_version():
    loader, unloaded = FakeLoader(), []
    m = make_manager(max_loras=1, max_cpu_loras=2, loader=loader, on_unload=unloaded.append)
    old, newer = loaded(m, "old", last_used=1.0), loaded(m, "newer", last_used=2.0)
    v = register(m, "third")
    m.add_user(v)
    await loader.finish(v)
    assert v.state is AdapterState.CPU
    assert old.state is AdapterState.REGISTERED and old.adapter is None and unloaded == [old]
    assert newer.state is AdapterState.CPU and m.stats["cpu_evictions"] == 1


async def test_cpu_tier_keeps_versions_in_use_or_in_a_slot():
    loader = FakeLoader()
    m = make_manager(max_loras=1, max_cpu_loras=2, loader=loader)
    slotted = in_slot(m, "slotted", last_used=1.0)
    used = loaded(m, "used", last_used=2.0)
    used.users = 1
    v = register(m, "third")
    m.add_user(v)
    await loader.finish(v)
    # nothing idle to evict: the tier runs over its size rather than drop what is needed
    assert [x.state for x in (slotted, used, v)] == [AdapterState.CPU] * 3
    assert m.stats["cpu_evictions"] == 0
    used.users = 0
    assert m.make_room() and used.state is AdapterState.REGISTERED
    assert not m.make_room()  # the slotted one is held by its slot, the new one by its user


def test_make_room_evicts_one_lru_idle_version():
    m = make_manager(max_loras=1, max_cpu_loras=4)
    a, b, c = (loaded(m, n, last_used=t) for n, t in (("a", 3.0), ("b", 1.0), ("c", 2.0)))
    assert m.make_room()
    assert [x.state for x in (a, b, c)] == [
        AdapterState.CPU,
        AdapterState.REGISTERED,
        AdapterState.CPU,
    ]
    assert m.stats["cpu_evictions"] == 1


def test_operator_pin_keeps_the_slot_and_so_the_cpu_copy():
    m = make_manager(max_loras=1, max_cpu_loras=1)
    pinned = in_slot(m, "pinned")
    m.pin("pinned")
    assert not m.make_room() and pinned.state is AdapterState.CPU
    v = loaded(m, "other")
    with pytest.raises(SlotFullError):
        m.assign_slot(v)
    assert pinned.slot == 0 and m.slot_owner(0) is pinned


# -- GPU slots ----------------------------------------------------------------------------------


def test_free_slots_are_taken_first_in_order():
    m = make_manager(max_loras=3, max_cpu_loras=3)
    a, b = loaded(m, "a"), loaded(m, "b")
    assert m.can_assign_slot()
    assert m.assign_slot(a) == 0 and m.assign_slot(b) == 1
    assert a.slot_ready is False and m.assign_slot(a) == 0  # already has one: unchanged
    assert m.resident == [a, b] and m.slot_owner(2) is None and m.stats["gpu_evictions"] == 0


def test_full_slots_evict_the_lru_unreferenced_owner():
    m = make_manager(max_loras=3, max_cpu_loras=4)
    busy = in_slot(m, "busy", last_used=0.5)
    busy.slot_refs = 1  # a running request reads it: never taken, however old
    old, recent = in_slot(m, "old", last_used=1.0), in_slot(m, "recent", last_used=2.0)
    v = loaded(m, "new")
    assert m.can_assign_slot()
    assert old.slot == 1
    assert m.assign_slot(v) == 1
    assert old.slot is None and old.slot_ready is False and m.slot_owner(1) is v
    assert v.slot == 1 and v.slot_ready is False  # usable once its write lands
    assert busy.slot == 0 and recent.slot == 2 and m.stats["gpu_evictions"] == 1


@pytest.mark.parametrize(
    "why, owner, force, takeable",
    [
        ("idle", dict(), False, True),
        ("read by a running request", dict(slot_refs=1), True, False),
        ("its write has not landed", dict(slot_ready=False), True, False),
        ("operator pin", dict(pinned=True), True, False),
        ("requests wait for it", dict(users=2), False, False),
        ("requests wait for it, a starved request forces", dict(users=2), True, True),
    ],
)
def test_which_owner_may_lose_its_slot(why, owner, force, takeable):
    m = make_manager(max_loras=2, max_cpu_loras=3)
    o = in_slot(m, "owner")
    in_slot(m, "busy").slot_refs = 1  # never takeable (and not every slot is pinned)
    for k, val in owner.items():
        setattr(o, k, val)
    v = loaded(m, "new")
    # the two entry points decide alike (one idle-slot check)
    assert m.can_assign_slot(force=force) is takeable, why
    slot = m.assign_slot(v, force=force)
    assert (slot == 0) is takeable and (m.slot_owner(0) is (v if takeable else o)), why
    assert (o.slot is None) is takeable and (v.slot == slot)


def test_pin_holds_for_the_current_version_only():
    m = make_manager(max_loras=1, max_cpu_loras=3)
    old = in_slot(m, "sql", digest="d1")
    m.pin("sql")
    old.users = 1  # a request waits for it: only a starved request could take its slot
    other = loaded(m, "other")
    assert not m.can_assign_slot(force=True)  # pinned
    new = loaded(m, "sql", digest="d2")  # the name gets new content
    assert new.pinned and m.get("sql") is new  # the pin belongs to the name
    assert old in m.versions()  # still used: it drains on its slot
    assert not m.can_assign_slot() and m.assign_slot(other) is None  # it has a user
    assert m.can_assign_slot(force=True)  # the old version's pin no longer holds
    assert m.assign_slot(other, force=True) == 0 and old.slot is None


def test_all_slots_pinned_raises_slot_full():
    m = make_manager(max_loras=2, max_cpu_loras=3)
    in_slot(m, "a")
    in_slot(m, "b")
    m.pin("a")
    m.pin("b")
    v = loaded(m, "c")
    assert not m.can_assign_slot(force=True)
    with pytest.raises(SlotFullError):
        m.assign_slot(v, force=True)
    assert v.slot is None


def test_slot_eviction_drops_the_evicted_cpu_copy_when_over_the_tier():
    m = make_manager(max_loras=1, max_cpu_loras=1)
    old = in_slot(m, "old")
    v = loaded(m, "new")  # the tier holds two now: old stays while it has its slot
    assert m.assign_slot(v) == 0
    assert old.state is AdapterState.REGISTERED and old.adapter is None
    assert v.state is AdapterState.CPU and m.stats["cpu_evictions"] == 1


# -- registry -----------------------------------------------------------------------------------


def test_same_content_keeps_the_current_version():
    dropped = []
    m = make_manager(on_drop=dropped.append)
    cur = register(m, "sql", "d1")
    dup = m.new_version("sql", "file:///elsewhere")
    dup.digest = "d1"
    assert m.register(dup) is cur and dropped == [dup] and m.versions() == [cur]


def test_superseded_version_lives_while_used_then_frees_its_slot():
    dropped = []
    m = make_manager(max_loras=1, max_cpu_loras=2, on_drop=dropped.append)
    old = in_slot(m, "sql", digest="d1")
    old.users = 1
    m.acquire_slot(old)
    new = register(m, "sql", "d2")
    assert m.versions() == [old, new] and m.slot_owner(0) is old
    m.release_slot(old)
    m.drop_user(old)  # its last request ends: forgotten, slot free
    assert m.versions() == [new] and dropped == [old]
    assert m.slot_owner(0) is None and old.slot is None and old.adapter is None


def test_unregister_and_forget():
    m = make_manager()
    v = register(m, "sql")
    m.unregister("sql")
    assert m.names() == [] and v not in m.versions()
    with pytest.raises(AdapterNotFoundError):
        m.unregister("sql")
    w = register(m, "poem")
    stale = m.new_version("poem", "x")  # never registered: forget leaves the current one
    m.forget(stale)
    assert m.get("poem") is w
    m.forget(w)
    assert m.names() == []
