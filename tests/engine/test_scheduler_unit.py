"""Scheduler on its own: a fake block manager, the adapter manager with a fake loader, no
model, no engine. Each test drives ``schedule`` / ``chain`` / ``finish`` as the engine core
does and checks the queues, KV blocks and adapter references left behind. The fakes and
helpers are tests/helpers/scheduler.py's (shared with test_scheduler_adapters.py, adapter
loads and slots on admission, and test_scheduler_chain.py).
"""

from __future__ import annotations

import asyncio

from loraplex.engine.adapters.registry import AdapterState
from loraplex.engine.request import RequestStatus
from tests.helpers.adapters import in_slot, register_version, settle
from tests.helpers.scheduler import (
    check_references,
    make,
    rows,
    run_step,
    submit,
)

# -- admission ----------------------------------------------------------------------------------


def test_base_request_is_admitted_whole():
    s, blocks, _, _ = make()
    r = submit(s, "a", 6)
    plan = s.schedule()
    assert rows(plan) == [("a", 6, True)] and not plan.slot_writes and not plan.failed
    assert s.running == [r] and not s.waiting and r.scheduled_time is not None
    assert blocks.tables == {"a": 2} and blocks.keys == {"a": None}
    check_references(s, blocks)


def test_prefix_cache_hit_skips_the_cached_tokens():
    s, blocks, _, _ = make()
    blocks.cached["a"] = 4
    r = submit(s, "a", 6)
    assert rows(s.schedule()) == [("a", 2, True)]
    assert r.num_computed == r.num_cached == 4


def test_fifo_on_kv_memory():
    s, blocks, _, _ = make(num_blocks=3)
    big = submit(s, "big", 13)  # 4 blocks: never fits now
    small = submit(s, "small", 3)
    assert s.schedule().empty  # the small one would take blocks the big one needs
    assert list(s.waiting) == [big, small] and blocks.tables == {}


# -- budgets ------------------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    s, blocks, _, _ = make(max_num_batched_tokens=8)
    r = submit(s, "a", 20)
    seen = []
    for _ in range(3):
        plan = s.schedule()
        seen += rows(plan)
        run_step(s, plan)
    assert seen == [("a", 8, False), ("a", 8, False), ("a", 4, True)]
    assert r.num_computed == 20 and blocks.computed["a"] == 20 and r.output_ids == [7]
    assert rows(s.schedule()) == [("a", 1, True)]  # then it decodes


def test_running_requests_first_waiting_ones_get_what_is_left():
    s, blocks, _, _ = make(max_num_batched_tokens=8)
    a = submit(s, "a", 3)
    run_step(s, s.schedule())  # a decodes from now on
    b = submit(s, "b", 20)
    plan = s.schedule()
    assert rows(plan) == [("a", 1, True), ("b", 7, False)]  # decodes never wait behind it
    run_step(s, plan)
    c = submit(s, "c", 2)
    plan = s.schedule()
    assert rows(plan) == [("a", 1, True), ("b", 7, False)]  # no budget left for c
    assert list(s.waiting) == [c] and a.num_computed == 4 and b.num_computed == 7


def test_max_num_seqs_caps_the_rows_of_a_step():
    s, blocks, _, _ = make(max_num_seqs=2)
    reqs = [submit(s, f"r{i}", 2) for i in range(3)]
    plan = s.schedule()
    assert [c.req for c in plan.chunks] == reqs[:2] and list(s.waiting) == reqs[2:]
    run_step(s, plan)
    assert len(s.schedule().chunks) == 2 and list(s.waiting) == reqs[2:]
    s.finish(reqs[0], "stop")
    assert [c.req for c in s.schedule().chunks] == reqs[1:]


# -- preemption ---------------------------------------------------------------------------------


def test_preemption_by_recompute_youngest_first():
    s, blocks, m, _ = make(num_blocks=3)
    v = in_slot(m, "sql")
    a, b = submit(s, "a", 4), submit(s, "b", 4)
    c = submit(s, "c", 4, v)
    run_step(s, s.schedule())  # each holds its one full block, and samples a 5th token
    assert blocks.num_free_blocks == 0 and s.slots.refs(v) == 1
    plan = s.schedule()
    # a needs a 2nd block: the youngest (c) is preempted for it; b then finds none and, the
    # youngest left, preempts itself
    assert rows(plan) == [("a", 1, True)]
    assert s.running == [a] and list(s.waiting) == [b, c] and s.num_preemptions == 2
    for r in (b, c):
        assert r.status is RequestStatus.WAITING and r.num_computed == 0
        assert r.num_preemptions == 1 and r.request_id not in blocks
    assert s.slots.refs(v) == 0 and not c.holds_slot and v.users == 1  # c still uses v: it waits
    assert blocks.tables == {"a": 2}
    check_references(s, blocks)
    run_step(s, plan)
    s.finish(a, "stop")
    plan = s.schedule()  # recomputed from the start, oldest first
    assert rows(plan) == [("b", 5, True)] and list(s.waiting) == [c]


def test_preempted_request_returns_its_slot_reference():
    s, blocks, m, _ = make(num_blocks=1)
    v = in_slot(m, "sql")
    r = submit(s, "a", 4, v)
    run_step(s, s.schedule())
    assert s.slots.refs(v) == 1
    # alone and out of blocks: it preempts itself (the engine admits no request that could
    # not fit the whole cache; here it just shows what preemption returns)
    assert s.schedule().empty
    assert list(s.waiting) == [r] and s.slots.refs(v) == 0 and not r.holds_slot
    assert blocks.tables == {} and r.num_preemptions == 1


# -- finish / abort -----------------------------------------------------------------------------


def test_finish_of_a_running_request_returns_everything():
    s, blocks, m, _ = make()
    v = in_slot(m, "sql")
    r = submit(s, "a", 3, v)
    s.schedule()
    s.finish(r, "length")
    assert r.status is RequestStatus.FINISHED and r.finish_reason == "length"
    assert not s.running and "a" not in blocks and blocks.num_free_blocks == 64
    assert s.slots.refs(v) == 0 and v.users == 0 and not r.holds_slot and not s.has_work
    s.finish(r, "abort")  # a second finish changes nothing (counts would go negative)
    assert r.finish_reason == "length" and v.users == 0


def test_abort_of_a_waiting_request():
    s, blocks, m, _ = make()
    v = in_slot(m, "sql")
    r = submit(s, "a", 3, v)
    s.finish(r, "abort")
    assert not s.waiting and r.status is RequestStatus.FINISHED and r.finish_reason == "abort"
    assert v.users == 0 and s.slots.refs(v) == 0 and blocks.tables == {}


async def test_abort_of_the_last_waiter_cancels_its_load():
    s, blocks, m, loader = make()
    v = register_version(m, "sql")
    r = submit(s, "a", 3, v)
    s.schedule()
    await asyncio.sleep(0)  # the load runs (tests/adapters/test_registry.py: an abort before)
    task = v.load_task
    s.finish(r, "abort")
    await settle(task)
    assert task.cancelled() and v.state is AdapterState.REGISTERED and v.users == 0
    assert loader.calls == [v] and v.load_task is None


def test_mark_computed_advances_the_request_and_its_blocks():
    s, blocks, _, _ = make(max_num_batched_tokens=4)
    r = submit(s, "a", 10)
    chunk = s.schedule().chunks[0]
    s.mark_computed(chunk)
    assert r.num_computed == 4 and blocks.computed == {"a": 4}
