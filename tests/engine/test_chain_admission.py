"""Pipelined admission: a request that arrives while others decode joins a chained step (its
prefill next to rows fed on the device) instead of stopping pipelined decode. Clients see the
same tokens as with step-by-step scheduling."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.scheduler import make_scheduler, running

NAMES = [None, "sql", "poem", "chat", "math"]


async def staggered(model_dir, adapters, *, async_scheduling: bool, device: str = "cpu"):
    """Stream 0 decodes; stream k starts once stream 0 has 3k tokens (arrivals mid-decode)."""
    cfg = config(
        model_dir, async_scheduling=async_scheduling, max_loras=4, max_cpu_loras=4, device=device
    )
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        for name in adapters:  # resident first: admissions need no load
            await collect(engine, [5, 6], SamplingParams(max_tokens=1), adapter=name)
        engine.testing.step_log.clear()
        progress = [asyncio.Event() for _ in range(8)]
        greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)

        async def first():
            tokens = []
            async for out in engine.generate([9, 8, 7, 6], greedy, adapter="sql"):
                tokens += out.token_ids
                for k in range(1, 8):
                    if len(tokens) >= 3 * k:
                        progress[k].set()
            return tokens

        async def later(k: int):
            await progress[k].wait()
            prompt = [20 + k] * (2 + 3 * k)
            return (await collect(engine, prompt, greedy, adapter=NAMES[k % 5]))[0]

        results = await asyncio.gather(first(), *(later(k) for k in range(1, 8)))
        log = list(engine.testing.step_log)
        assert_idle(engine)
    admitted = sum(1 for e in log if e.pipelined and not e.decode)
    return results, admitted


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_requests_join_a_chained_step(tiny, device):
    """On CUDA the joined steps replay mixed-step graphs whose decode rows read the fed
    tokens on the device."""
    model_dir, adapters = tiny
    plain, n_plain = await staggered(model_dir, adapters, async_scheduling=False, device=device)
    piped, n_piped = await staggered(model_dir, adapters, async_scheduling=True, device=device)
    assert n_plain == 0
    assert n_piped > 0, "no request joined a chained step"
    assert piped == plain


def test_chain_admits_a_ready_waiting_request():
    s, blocks = make_scheduler(num_kv_blocks=8)
    a = running(s, "a", list(range(7)))
    plan = s.schedule()
    assert [c.req for c in plan.chunks] == [a]
    c = running(s, "c", [1, 2])  # base model: ready at once
    nxt = s.chain(plan, max_model_len=100)
    assert nxt is not None
    assert [(x.req, x.feed, x.num_tokens) for x in nxt.chunks] == [(a, True, 1), (c, False, 2)]
    assert c in s.running and not s.waiting
    assert len(blocks.block_table("c")) == 1
