"""Scheduler.chain on its own (pipelined decode): the decode step planned behind the one in
flight, which requests it takes, admits or leaves out, and when it refuses so that the next
plan comes from ``schedule``. Same fakes as test_scheduler_unit.py.
"""

from __future__ import annotations

import pytest

from loraplex.engine.adapters.registry import AdapterState, SlotFullError
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import ScheduledChunk, SchedulerOutput
from tests.helpers.adapters import in_slot, loaded, register_version
from tests.helpers.scheduler import make, rows, run_step, submit


def steady(num_blocks: int = 64, n: int = 2, **kw):
    """Requests decoding with every row sampling: the state ``chain`` may extend."""
    s, blocks, m, loader = make(num_blocks, **kw)
    reqs = [submit(s, f"r{i}", 3, max_tokens=8) for i in range(n)]
    run_step(s, s.schedule())
    plan = s.schedule()  # a decode step of every request, in flight
    assert rows(plan) == [(r.request_id, 1, True) for r in reqs]
    return s, blocks, m, loader, reqs, plan


def test_chain_plans_the_next_decode_step_in_the_steady_state():
    s, blocks, m, _, reqs, plan = steady()
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and not nxt.slot_writes
    assert [(c.req, c.num_tokens, c.need_logits, c.feed) for c in nxt.chunks] == [
        (r, 1, True, True) for r in reqs
    ]
    # KV room for the token in flight (4 tokens known, it is the 5th: a 2nd block each)
    assert blocks.tables == {"r0": 2, "r1": 2}


def test_chain_needs_a_plan_with_rows():
    s, *_ = make()  # (an early out: an empty plan also leaves no rows)
    assert s.chain(SchedulerOutput(), max_model_len=100) is None


def test_chain_goes_on_after_a_plan_with_slot_writes():
    s, blocks, m, _, reqs, plan = steady()
    plan.slot_writes.append(loaded(m, "sql"))  # the write lands while the chain runs
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and [c.req for c in nxt.chunks] == reqs


def test_chain_refuses_a_plan_with_a_row_that_does_not_sample():
    s, blocks, m, _, reqs, plan = steady()
    prefill = Request("p", [1, 2, 3], SamplingParams())
    plan.chunks.append(ScheduledChunk(prefill, 2, False))  # a prefill chunk
    assert s.chain(plan, max_model_len=100) is None


def test_chain_refuses_when_a_running_request_is_not_in_the_plan():
    s, blocks, m, _, reqs, plan = steady()
    plan.chunks.pop()  # e.g. left out by the token budget
    assert s.chain(plan, max_model_len=100) is None


def test_chain_admits_a_waiting_request_that_fits():
    s, blocks, m, _, reqs, plan = steady()
    w = submit(s, "w", 3)
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None
    assert [(c.req, c.num_tokens, c.need_logits, c.feed) for c in nxt.chunks] == [
        *((r, 1, True, True) for r in reqs),
        (w, 3, True, False),  # its prefill rides along with the fed decode rows
    ]
    assert w in s.running and not s.waiting and w.status is RequestStatus.RUNNING
    assert blocks.tables["w"] == 1


def test_chain_admits_a_waiting_request_whose_slot_is_written():
    s, blocks, m, _, reqs, plan = steady()
    v = in_slot(m, "sql")
    w = submit(s, "w", 3, v)
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and nxt.chunks[-1].req is w and w.holds_slot and s.slots.refs(v) == 1


def test_chain_refuses_when_a_waiting_request_is_starved():
    s, blocks, m, _, reqs, plan = steady()
    submit(s, "w", 3, starved=True)  # the starvation policy is schedule's
    assert s.chain(plan, max_model_len=100) is None


def test_chain_refuses_when_a_waiting_request_would_fail():
    s, blocks, m, _, reqs, plan = steady()
    v = loaded(m, "bad")
    submit(s, "w", 3, v)
    m._set_state(v, AdapterState.FAILED)
    assert s.chain(plan, max_model_len=100) is None


def test_chain_fails_a_waiting_request_for_want_of_a_slot_as_schedule_does():
    s, blocks, m, _, reqs, plan = steady(max_loras=1)
    in_slot(m, "pinned")
    m.pin("pinned")
    submit(s, "w", 3, loaded(m, "sql"))
    assert [type(e) for _, e in s.schedule().failed] == [SlotFullError]  # what schedule does
    s, blocks, m, _, reqs, plan = steady(max_loras=1)
    in_slot(m, "pinned")
    m.pin("pinned")
    w = submit(s, "w", 3, loaded(m, "sql"))
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and [c.req for c in nxt.chunks] == reqs
    assert [(r, type(e)) for r, e in nxt.failed] == [(w, SlotFullError)] and not s.waiting


@pytest.mark.parametrize("join", [True, False])
def test_chain_gives_a_loaded_adapter_its_slot(join):
    s, blocks, m, _, reqs, plan = steady(slot_write_join_bytes=(128 << 20) * join)
    v = loaded(m, "sql")  # loaded, a slot is free
    w = submit(s, "w", 3, v)
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and nxt.slot_writes == [v] and s.slots.slot_of(v) is not None
    if join:  # its prefill rides in the step that writes the slot
        assert [c.req for c in nxt.chunks] == [*reqs, w] and not s.waiting
    else:  # it runs once the write landed
        assert [c.req for c in nxt.chunks] == reqs and list(s.waiting) == [w]


@pytest.mark.parametrize("starved", [False, True])
def test_chain_with_a_waiting_request_whose_slot_is_taken(starved):
    s, blocks, m, _, reqs, plan = steady(max_loras=1)
    owner = in_slot(m, "owner")
    m.add_user(owner)  # waited for: only a starved request may take its slot
    submit(s, "w", 3, loaded(m, "sql"), starved=starved)
    assert (s.chain(plan, max_model_len=100) is None) is starved


async def test_chain_goes_on_while_a_waiting_adapter_loads():
    s, blocks, m, loader, reqs, plan = steady()
    v = register_version(m, "sql")
    s.add(Request("w", [1, 2], SamplingParams(), v))  # no user counted: no load started yet
    assert v.state is AdapterState.REGISTERED
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and len(nxt.chunks) == 2
    assert v.state is AdapterState.LOADING  # the load schedule would start is started
    await loader.finish(v)


def test_chain_goes_on_while_a_waiting_adapter_slot_is_written():
    s, blocks, m, _, reqs, plan = steady()
    v = loaded(m, "sql")
    s.slots.assign(v)  # its write is in flight
    submit(s, "w", 3, v)
    assert s.chain(plan, max_model_len=100) is not None


def test_chain_goes_on_when_the_waiting_head_has_no_kv_room():
    s, blocks, m, _, reqs, plan = steady(num_blocks=6)
    submit(s, "w", 17)  # 5 blocks, 4 free: FIFO on memory holds everyone behind it too
    submit(s, "x", 1)
    assert s.chain(plan, max_model_len=100) is not None


def test_chain_goes_on_when_max_num_seqs_is_reached():
    s, blocks, m, _, reqs, plan = steady(max_num_seqs=2)
    submit(s, "w", 3)
    assert s.chain(plan, max_model_len=100) is not None


def test_chain_leaves_out_finished_and_aborted_requests():
    s, blocks, m, _, reqs, plan = steady(n=3)
    s.finish(reqs[0], "stop")  # e.g. ended by a stop string in postprocess
    reqs[1].aborted = True  # the client went away; the engine finishes it after the step
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and [c.req for c in nxt.chunks] == [reqs[2]]


def test_chain_leaves_out_a_request_that_is_no_longer_running():
    s, blocks, m, _, reqs, plan = steady()
    reqs[0].status = RequestStatus.WAITING  # (defensive: nothing between the two does this)
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and [c.req for c in nxt.chunks] == [reqs[1]]


def test_chain_leaves_out_a_request_whose_token_in_flight_is_its_last():
    s, blocks, m, _, reqs, plan = steady()
    reqs[0].params = SamplingParams(max_tokens=2)  # 1 sampled, the 2nd in flight
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and [c.req for c in nxt.chunks] == [reqs[1]]
    assert blocks.tables["r0"] == 1  # and takes no block for it


def test_chain_leaves_out_a_request_at_the_context_limit():
    s, blocks, m, _, reqs, plan = steady()
    reqs[1].output_ids.append(7)  # 5 tokens known: the 6th in flight would be the last
    nxt = s.chain(plan, max_model_len=6)
    assert nxt is not None and [c.req for c in nxt.chunks] == [reqs[0]]


def test_chain_refuses_when_no_row_is_left():
    s, blocks, m, _, reqs, plan = steady()
    assert s.chain(plan, max_model_len=5) is None


def test_chain_refuses_without_free_blocks_and_takes_none():
    s, blocks, m, _, reqs, plan = steady(num_blocks=3)  # each holds 1, both need a 2nd
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is None and blocks.tables == {"r0": 1, "r1": 1}
    assert s.num_preemptions == 0 and all(r.status is RequestStatus.RUNNING for r in reqs)


def test_no_join_while_an_earlier_write_lands_or_over_the_byte_budget():
    s, _, m, _, reqs, plan = steady()
    u = loaded(m, "u")
    s.slots.assign(u)  # its write was issued earlier and has not landed
    w = submit(s, "w", 3, loaded(m, "sql"))
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and [c.req for c in nxt.chunks] == reqs and list(s.waiting) == [w]
    s, _, m, _, reqs, plan = steady(slot_write_join_bytes=1)  # every adapter is over it
    w = submit(s, "w", 3, loaded(m, "sql"))
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None and [c.req for c in nxt.chunks] == reqs and list(s.waiting) == [w]
