"""Fair share of ``max_num_seqs`` between API requests (scheduler policy 5, fair_share.py): the
sibling engine requests of one request with ``n`` choices cannot keep a plain request behind
them waiting until they end. Steps are counted, never seconds."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.server import create_app, start_server
from tests.helpers.adapters import register_version
from tests.helpers.lifecycle import wait_until
from tests.helpers.scheduler import check_references, make, run_step, submit
from tests.helpers.slots import land

NO_LIMIT = 10_000  # max_tokens of a request sent without one (the context length's worth)


def siblings(s: Scheduler, reply: str, n: int, n_prompt: int = 3) -> list[Request]:
    """What the server queues for one request with ``n`` choices (ids as server/generation.py)."""
    return [
        submit(s, f"{reply}-0-{i}", n_prompt, max_tokens=NO_LIMIT, group=reply) for i in range(n)
    ]


def step(s: Scheduler) -> SchedulerOutput:
    """One step: schedule, run, and finish the requests that reached their max_tokens."""
    plan = s.schedule()
    run_step(s, plan)
    for c in plan.chunks:
        if len(c.req.output_ids) >= c.req.params.max_tokens:
            s.finish(c.req, "length")
    return plan


def group_running(s: Scheduler, group: str) -> int:
    return sum(r.group == group for r in s.running)


def test_a_request_without_a_group_is_a_group_of_its_own():
    assert Request("cmpl-ab-0-3", [1], None).group == "cmpl-ab-0-3"  # type: ignore[arg-type]
    assert Request("x", [1], None, group="g").group == "g"  # type: ignore[arg-type]


def test_lone_n128_request_takes_every_seat():
    s, blocks, _, _ = make(num_blocks=100_000, max_num_seqs=64, max_num_batched_tokens=2048)
    big = siblings(s, "cmpl-big", 128)
    for _ in range(20):
        step(s)
        assert s.running == big[:64] and list(s.waiting) == big[64:]
    assert s.num_preemptions == 0
    check_references(s, blocks)


def test_plain_request_next_to_n128_starts_at_once_and_ends_while_it_runs():
    s, blocks, _, _ = make(num_blocks=100_000, max_num_seqs=64, max_num_batched_tokens=2048)
    big = siblings(s, "cmpl-big", 128)
    for _ in range(5):
        step(s)
    assert group_running(s, "cmpl-big") == 64
    plain = submit(s, "cmpl-plain-0-0", 4, max_tokens=8)
    plan = step(s)
    # admitted in the very next step: the youngest sibling gave up its seat, no other
    assert plain in [c.req for c in plan.chunks] and plain.status is RequestStatus.RUNNING
    assert s.num_preemptions == 1 and big[63].num_preemptions == 1
    assert s.waiting[0] is big[63] and len(s.running) == 64
    check_references(s, blocks)
    steps = 1
    while not plain.is_finished:
        plan = step(s)
        steps += 1
        assert len(plan.chunks) == 64  # every seat in use meanwhile
    assert steps == 8 and plain.finish_reason == "length" and len(plain.output_ids) == 8
    assert s.num_preemptions == 1  # no back and forth
    # alone again: the big request takes the freed seat back at once
    step(s)
    assert group_running(s, "cmpl-big") == 64 and big[63] in s.running
    check_references(s, blocks)


def test_two_n128_requests_split_the_seats():
    s, _, _, _ = make(num_blocks=100_000, max_num_seqs=64, max_num_batched_tokens=2048)
    siblings(s, "cmpl-a", 128)
    step(s)
    siblings(s, "cmpl-b", 128)
    step(s)
    assert group_running(s, "cmpl-a") == 32 and group_running(s, "cmpl-b") == 32
    assert s.num_preemptions == 32
    for _ in range(10):
        step(s)
    assert group_running(s, "cmpl-a") == 32 and group_running(s, "cmpl-b") == 32
    assert s.num_preemptions == 32


async def test_no_seat_is_taken_for_a_request_whose_adapter_is_not_in_a_slot_yet():
    s, _, m, loader = make(num_blocks=100_000, max_num_seqs=8)
    siblings(s, "cmpl-big", 16)
    step(s)
    v = register_version(m, "sql")
    plain = submit(s, "plain", 3, v)
    for _ in range(3):
        plan = step(s)
        assert len(plan.chunks) == 8 and group_running(s, "cmpl-big") == 8
    assert s.num_preemptions == 0
    await asyncio.sleep(0)
    assert loader.calls  # its load started meanwhile (every seat taken or not)
    await loader.finish(v)
    plan = step(s)  # its slot write is issued: still no seat taken for it
    assert plan.slot_writes == [v] and s.num_preemptions == 0 and len(plan.chunks) == 8
    land(s.slots, v)  # the write landed
    step(s)
    assert plain.status is RequestStatus.RUNNING and s.num_preemptions == 1


def test_requests_within_their_share_are_never_preempted_for_fairness():
    s, _, _, _ = make(num_blocks=100_000, max_num_seqs=4)
    plain = [submit(s, f"r{i}", 3, max_tokens=NO_LIMIT) for i in range(4)]
    step(s)
    late = siblings(s, "cmpl-big", 4)
    for _ in range(5):
        step(s)
    assert s.running == plain and list(s.waiting) == late and s.num_preemptions == 0


def test_kv_preemption_takes_a_sibling_of_the_group_above_its_share():
    s, blocks, _, _ = make(num_blocks=100_000, max_num_seqs=4)
    big = siblings(s, "cmpl-big", 4, n_prompt=4)
    step(s)  # each holds one block and has 5 tokens
    plain = submit(s, "plain", 2, max_tokens=NO_LIMIT)
    step(s)  # the youngest sibling made room: share 2, the group holds 3
    assert s.running == [*big[:3], plain] and s.num_preemptions == 1
    for _ in range(3):
        step(s)  # siblings reach 9 tokens, plain 6 (2 blocks each)
    blocks.num_blocks = sum(blocks.tables.values())  # no free block left
    plan = step(s)  # the oldest sibling needs a 3rd block: a sibling gives it, not plain
    assert [c.req for c in plan.chunks] == [big[0], big[1], plain]
    assert big[2].status is RequestStatus.WAITING and plain.num_preemptions == 0
    check_references(s, blocks)


def test_a_due_fair_preemption_is_not_chained():
    s, _, _, _ = make(num_blocks=100_000, max_num_seqs=8)
    siblings(s, "cmpl-big", 16)
    step(s)
    plan = step(s)
    assert s.chain(plan, max_model_len=10_000) is not None  # alone: pipelined as before
    submit(s, "plain", 3)
    assert s.chain(plan, max_model_len=10_000) is None  # ``schedule`` makes room


# -- the server: one request with n=128 and no max_tokens, one plain request ----------------------


@pytest.fixture
async def served(tiny):
    model_dir, _ = tiny
    cfg = EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        served_model_name="tiny",
        block_size=4,
        max_num_seqs=64,
        max_model_len=256,
        kv_cache_bytes=32 << 20,
    )
    async with AsyncEngine(cfg) as engine:
        runner, port = await start_server(create_app(engine))
        try:
            yield engine, f"http://127.0.0.1:{port}/v1"
        finally:
            await runner.cleanup()


async def test_plain_request_completes_while_an_n128_request_runs(served):
    import openai

    engine, url = served
    client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
    sched = engine.testing.scheduler
    plain_prompt = [9, 8, 7, 6]
    marks: dict[str, int] = {}
    add, finish = sched.add, sched.finish

    def on_add(req: Request) -> None:  # the step count when the plain request reaches it
        add(req)
        if req.prompt_ids == plain_prompt:
            marks["added"] = engine.stats()["steps"]

    def on_finish(req: Request, reason: str) -> None:
        finish(req, reason)
        if req.prompt_ids == plain_prompt:
            marks["finished"] = engine.stats()["steps"]
            marks["big_running"] = sum(r.prompt_ids != plain_prompt for r in sched.running)

    sched.add, sched.finish = on_add, on_finish
    big = await client.completions.create(
        model="tiny", prompt=[5, 6, 7], n=128, stream=True, extra_body={"ignore_eos": True}
    )
    big_chunks = 0

    async def consume() -> None:
        nonlocal big_chunks
        async for _ in big:
            big_chunks += 1

    task = asyncio.create_task(consume())
    try:
        # alone, it holds every seat
        await wait_until(
            lambda: len(sched.running) == 64 and len(sched.waiting) == 64 and big_chunks > 0,
            "the n=128 request streaming on every seat",
        )
        plain = await client.completions.create(
            model="tiny", prompt=plain_prompt, max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert plain.choices[0].finish_reason == "length"
        assert plain.usage.completion_tokens == 8
        # its 8 tokens took about 8 steps (a step in flight when it came, pipelining), not
        # the ~250 steps until 128 sequences of up to 253 tokens end 64 at a time
        assert marks["finished"] - marks["added"] <= 16, marks
        assert marks["big_running"] == 63 and not task.done()  # the big one went on beside it
        assert engine.stats()["preemptions"] == 1
        await wait_until(lambda: len(sched.running) == 64, "the seat given back")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await big.close()
    await wait_until(lambda: not sched.running and not sched.waiting, "the n=128 request aborted")
