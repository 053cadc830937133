"""Pipelined decode (``async_scheduling``): the next step is queued before the running one's
tokens reach the host. It must change nothing a client can see."""

from __future__ import annotations

import asyncio
import functools
import random

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.request import Request, RequestStatus
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.scheduler import make_scheduler, running


def requests(seed: int) -> list[tuple]:
    """Mixed adapters, prompt lengths across block boundaries, greedy and seeded sampling,
    logprobs, min_tokens, different max_tokens."""
    g = random.Random(seed)
    out = []
    for i in range(14):
        prompt = [g.randrange(3, 250) for _ in range(g.randint(1, 30))]
        kw = dict(max_tokens=g.randint(2, 17), ignore_eos=True)
        if i % 3 == 1:
            kw.update(temperature=0.9, top_p=0.9, top_k=40, seed=1000 + i)
        else:
            kw.update(temperature=0.0)
        if i % 4 == 2:
            kw.update(logprobs=3)
        if i % 5 == 3:
            kw.update(min_tokens=2)
        out.append((f"r{i}", prompt, [None, "sql", "poem", "chat", "math"][i % 5], kw))
    return out


async def run_all(
    model_dir, adapters, reqs, *, async_scheduling: bool, stop_ids=None, device: str = "cpu"
):
    cfg = config(
        model_dir, async_scheduling=async_scheduling, max_loras=4, max_cpu_loras=4, device=device
    )
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        for name in adapters:  # every adapter resident first: steady decode from the start
            await collect(engine, [5, 6], SamplingParams(max_tokens=1), adapter=name)
        engine.testing.step_log.clear()
        results = await asyncio.gather(
            *(
                collect(
                    engine,
                    p,
                    SamplingParams(**kw, stop_token_ids=(stop_ids or {}).get(rid)),
                    adapter=a,
                    request_id=rid,
                )
                for rid, p, a, kw in reqs
            )
        )
        pipelined = sum(1 for e in engine.testing.step_log if e.pipelined)
        assert_idle(engine)
    return results, pipelined


def summary(results):
    return [
        (
            tokens,
            outs[-1].finish_reason,
            outs[-1].stop_reason,
            [(lp.token_id, round(lp.logprob, 5), lp.top) for o in outs for lp in o.logprobs or []],
        )
        for tokens, _, outs in results
    ]


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
async def test_pipelined_decode_matches_step_by_step(tiny, device):
    """On CUDA this runs the graph path: fed rows read the previous step's tokens on device."""
    model_dir, adapters = tiny
    reqs = requests(3)
    run = functools.partial(run_all, model_dir, adapters, reqs, device=device)
    plain, n_plain = await run(async_scheduling=False)
    assert n_plain == 0
    # stop tokens seen mid-stream: those requests end while their next step is in flight
    stop_ids = {rid: [res[0][2]] for (rid, *_), res in zip(reqs, plain, strict=True)}
    stop_ids = {rid: ids for i, (rid, ids) in enumerate(stop_ids.items()) if i % 2 == 0}
    plain, _ = await run(async_scheduling=False, stop_ids=stop_ids)
    piped, n_piped = await run(async_scheduling=True, stop_ids=stop_ids)
    assert n_piped > 0, "no step was pipelined"
    for got, want in zip(summary(piped), summary(plain), strict=True):
        assert got[:3] == want[:3]
        for (t1, lp1, top1), (t2, lp2, top2) in zip(got[3], want[3], strict=True):
            assert t1 == t2 and abs(lp1 - lp2) < 1e-4
            assert [t for t, _ in top1] == [t for t, _ in top2]
    assert any(r[1] == "stop" for r in summary(piped))


async def test_abort_while_pipelined_leaks_nothing(tiny):
    model_dir, adapters = tiny
    cfg = config(model_dir, max_loras=4, max_cpu_loras=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        names = [None, "sql", "poem", "chat", "math"]
        seen = asyncio.Event()

        async def run(i: int):
            n = 0
            async for out in engine.generate([7 + i] * (3 + i), params, adapter=names[i % 5]):
                n += len(out.token_ids)
                if n == 6 and any(e.pipelined for e in engine.testing.step_log):
                    seen.set()
            return n, out.finish_reason

        tasks = [asyncio.create_task(run(i), name=f"r{i}") for i in range(8)]
        await asyncio.wait_for(seen.wait(), 60)
        for i, t in enumerate(tasks):
            if i % 2:
                t.cancel()  # the client goes away: abort mid-stream
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for i, d in enumerate(done):
            if i % 2 == 0:
                assert d == (40, "length")
            else:
                assert isinstance(d, asyncio.CancelledError)
        assert_idle(engine)
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]


def test_chain_only_in_the_steady_state():
    s, blocks = make_scheduler(num_kv_blocks=6)
    a = running(s, "a", list(range(7)))
    b = running(s, "b", list(range(3)), max_tokens=1)
    plan = s.schedule()
    assert [c.req for c in plan.chunks] == [a, b] and all(c.need_logits for c in plan.chunks)
    nxt = s.chain(plan, max_model_len=100)
    # b's token in flight is its last (max_tokens=1): only a decodes on, at position 7
    assert nxt is not None and [(c.req, c.feed) for c in nxt.chunks] == [(a, True)]
    assert len(blocks.block_table("a")) == 2  # 8 tokens of block size 4
    # a starved waiting request goes to a normal schedule (its admission policy): no chain
    # (one that is not starved joins the chained step: test_chain_admission.py)
    c = running(s, "c", [1, 2])
    c.arrival -= 1e6
    assert s.chain(plan, max_model_len=100) is None
    s.waiting.remove(c)
    # a running request outside the plan (e.g. left out by a budget): no chain
    s.running.append(c)
    c.status = RequestStatus.RUNNING
    assert s.chain(plan, max_model_len=100) is None
    s.running.remove(c)
    # the next token would pass max_model_len: left out, nothing left to chain
    assert s.chain(plan, max_model_len=8) is None
    # no free block for the next position: no chain (and no preemption)
    a.output_ids = [9] * 2  # position 9 needs a third block
    filler = Request("f", list(range(4 * blocks.num_free_blocks)), SamplingParams())
    blocks.allocate(filler.request_id, filler.tokens, None)
    assert blocks.num_free_blocks == 0
    assert s.chain(plan, max_model_len=100) is None
    assert all(r.status is RequestStatus.RUNNING for r in (a, b)) and s.num_preemptions == 0
    assert len(blocks.block_table("a")) == 2  # a refused chain takes no block
