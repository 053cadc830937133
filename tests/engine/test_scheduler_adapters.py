"""Scheduler admission of adapter requests: a request waits while its adapter loads (the
scheduler starts the load), gets a slot write once loaded and runs once the write has landed;
with no free slot it waits for an unreferenced one, evicts the least recently used, keeps a
slot that waiters need unless a request starves, and fails when every slot is pinned or its
adapter's load failed. Same fakes as test_scheduler_unit.py.
"""

from __future__ import annotations

import asyncio
import time

from loraplex.engine.adapters.registry import AdapterState, SlotFullError
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from tests.helpers.adapters import in_slot, loaded, register_version
from tests.helpers.scheduler import check_references, make, rows, run_step, submit
from tests.helpers.slots import land

# -- loads and slot writes ----------------------------------------------------------------------


async def test_adapter_not_loaded_waits_while_others_run():
    s, blocks, m, loader = make()
    v = register_version(m, "sql")
    r = submit(s, "a", 3, v)  # its first user starts the load
    base = submit(s, "b", 3)
    plan = s.schedule()
    assert rows(plan) == [("b", 3, True)]  # skipped, not waited on
    assert list(s.waiting) == [r] and v.state is AdapterState.LOADING
    run_step(s, plan)
    assert rows(s.schedule()) == [("b", 1, True)] and list(s.waiting) == [r]
    await asyncio.sleep(0)
    assert len(loader.calls) == 1  # one load, however often asked
    assert blocks.tables == {"b": 1} and base.status is RequestStatus.RUNNING
    await loader.finish(v)
    assert v.state is AdapterState.CPU


async def test_schedule_starts_the_load_of_a_waiting_adapter():
    s, blocks, m, loader = make()
    v = register_version(m, "sql")
    r = Request("a", [1, 2, 3], SamplingParams(), v)
    s.add(r)  # queued without add_user: only the scheduler starts its load here
    assert s.schedule().empty and v.state is AdapterState.LOADING
    s.schedule()
    await asyncio.sleep(0)
    assert loader.calls == [v] and list(s.waiting) == [r]
    await loader.finish(v)


async def test_loaded_adapter_gets_a_slot_write_then_its_requests_run():
    s, blocks, m, loader = make(slot_write_join_bytes=0)  # requests wait for the write to land
    v = register_version(m, "sql")
    r1, r2 = submit(s, "a", 3, v), submit(s, "b", 5, v)
    s.schedule()
    await loader.finish(v)
    plan = s.schedule()
    assert plan.slot_writes == [v] and not plan.chunks  # the write joins this step
    assert s.slots.slot_of(v) == 0 and not s.slots.is_ready(v) and s.slots.owner(0) is v
    plan = s.schedule()  # the write has not landed: still waiting, no second write
    assert plan.empty and list(s.waiting) == [r1, r2]
    land(s.slots, v)  # the engine saw the write's event
    plan = s.schedule()
    assert rows(plan) == [("a", 3, True), ("b", 5, True)] and not plan.slot_writes
    assert s.slots.refs(v) == 2 and r1.holds_slot and r2.holds_slot
    assert blocks.keys == {"a": v.key, "b": v.key}  # prefix cache keyed by the version
    check_references(s, blocks)


async def test_schedule_never_joins_a_write_nothing_overlaps():
    s, _, m, loader = make()  # joins allowed, but only in chained steps
    v = register_version(m, "sql")
    r = submit(s, "a", 3, v)
    s.schedule()
    await loader.finish(v)
    plan = s.schedule()
    assert plan.slot_writes == [v] and not plan.chunks and list(s.waiting) == [r]


def test_adapter_in_a_ready_slot_is_admitted_at_once():
    s, blocks, m, _ = make()
    v = in_slot(m, "sql")
    r = submit(s, "a", 3, v)
    plan = s.schedule()
    assert rows(plan) == [("a", 3, True)] and not plan.slot_writes
    assert s.slots.refs(v) == 1 and r.holds_slot and v.users == 1
    check_references(s, blocks)


# -- no free slot -------------------------------------------------------------------------------


def test_no_free_slot_waits_until_a_slot_is_unreferenced():
    s, blocks, m, _ = make(max_loras=1)
    old = in_slot(m, "old")
    a = submit(s, "a", 3, old)
    run_step(s, s.schedule())  # a runs on old's slot
    v = loaded(m, "new")
    b = submit(s, "b", 3, v)
    plan = s.schedule()
    assert rows(plan) == [("a", 1, True)]
    assert not plan.slot_writes and s.slots.slot_of(v) is None and list(s.waiting) == [b]
    s.finish(a, "stop")
    assert s.slots.refs(old) == 0 and old.users == 0
    plan = s.schedule()
    assert plan.slot_writes == [v] and s.slots.slot_of(v) == 0 and s.slots.slot_of(old) is None
    assert m.stats["gpu_evictions"] == 1


def test_one_pass_asks_the_slots_once_for_waiters_with_no_slot_to_take(monkeypatch):
    """Every slot busy and many loaded adapters waiting: the pass learns from the first
    refused assign that the others would be refused too (one scan, not one per request)."""
    s, blocks, m, _ = make(max_loras=1, max_cpu_loras=40)
    old = in_slot(m, "old")
    submit(s, "a", 3, old)
    run_step(s, s.schedule())  # a runs: old's slot is referenced
    waiting = [loaded(m, f"v{i}") for i in range(30)]
    for i, v in enumerate(waiting):
        submit(s, f"w{i}", 3, v)
    asks = []
    assign = s.slots.assign
    monkeypatch.setattr(s.slots, "assign", lambda v, **kw: asks.append(v) or assign(v, **kw))
    plan = s.schedule()
    assert not plan.slot_writes and asks == [waiting[0]]
    assert all(s.slots.slot_of(v) is None for v in waiting)


def test_slot_eviction_takes_the_lru_unreferenced_slot():
    s, blocks, m, _ = make(max_loras=3, max_cpu_loras=4)
    busy = in_slot(m, "busy", last_used=0.0)
    submit(s, "a", 3, busy)
    run_step(s, s.schedule())  # busy is referenced, and the least recently used
    busy.last_used = 0.0
    lru, mru = in_slot(m, "lru", last_used=1.0), in_slot(m, "mru", last_used=2.0)
    v = loaded(m, "new")
    submit(s, "b", 3, v)
    plan = s.schedule()
    assert plan.slot_writes == [v] and s.slots.slot_of(v) == 1 and s.slots.slot_of(lru) is None
    assert s.slots.slot_of(busy) == 0 and s.slots.slot_of(mru) == 2


def test_a_slot_that_requests_wait_for_is_kept_unless_one_starves():
    s, blocks, m, _ = make(max_loras=1)
    held = in_slot(m, "held")
    m.add_user(held)  # a request of it waits (e.g. for KV blocks)
    v = loaded(m, "new")
    submit(s, "b", 3, v)
    assert s.schedule().empty and s.slots.slot_of(v) is None
    submit(s, "c", 3, v, starved=True)
    plan = s.schedule()
    assert (
        plan.slot_writes == [v] and s.slots.slot_of(held) is None
    )  # forced for the starved request


def test_starved_request_held_back_stops_later_admissions():
    s, blocks, m, _ = make(max_loras=1)
    busy = in_slot(m, "busy")
    submit(s, "a", 3, busy)
    run_step(s, s.schedule())
    v = loaded(m, "new")
    head = submit(s, "b", 3, v, starved=True)
    late = submit(s, "c", 3)
    plan = s.schedule()
    assert "c" not in [rid for rid, _, _ in rows(plan)]  # slots drain for the starved one
    assert list(s.waiting) == [head, late]
    head.arrival = time.monotonic()  # not starved: the base request goes ahead
    assert "c" in [rid for rid, _, _ in rows(s.schedule())]


def test_all_slots_pinned_fails_the_request():
    s, blocks, m, _ = make(max_loras=1)
    in_slot(m, "pinned")
    m.pin("pinned")
    v = loaded(m, "new")
    r = submit(s, "a", 3, v)
    base = submit(s, "b", 3)
    plan = s.schedule()
    assert len(plan.failed) == 1 and plan.failed[0][0] is r
    assert isinstance(plan.failed[0][1], SlotFullError)
    assert rows(plan) == [("b", 3, True)] and r not in s.waiting and base in s.running


# -- failures -----------------------------------------------------------------------------------


def test_failed_load_fails_only_its_requests():
    s, blocks, m, _ = make()
    bad, good = loaded(m, "bad"), in_slot(m, "good")
    r1, r2 = submit(s, "a", 3, bad), submit(s, "b", 3, bad)
    ok = submit(s, "c", 3, good)
    error = ValueError("corrupt")
    bad.state, bad.error, bad.adapter = AdapterState.FAILED, error, None  # its load failed
    plan = s.schedule()
    assert plan.failed == [(r1, error), (r2, error)]
    assert rows(plan) == [("c", 3, True)] and not s.waiting and s.running == [ok]
    for r in (r1, r2):  # the caller fails them: finish returns their user counts
        s.finish(r, "error")
    assert bad.users == 0 and good.users == 1
    check_references(s, blocks)
