"""Embedding / LM head LoRA adapters through AsyncEngine (cold loads, CPU tier, slot writes and
re-writes under eviction, prefix-cache identity) and one request through the HTTP server,
against HF PEFT."""

from __future__ import annotations

import asyncio
import random

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.models import make_peft_adapter
from tests.helpers.peft_oracle import HFReference, compare, http_greedy_ids

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def vocab(tiny, tmp_path_factory):
    model_dir, _ = tiny
    root = tmp_path_factory.mktemp("vocab-forms")
    return {
        "both": make_peft_adapter(
            model_dir, root / "both", seed=41, r=4, alpha=8,
            target_modules=["embed_tokens", "q_proj", "down_proj", "lm_head"],
        ),
        "head": make_peft_adapter(
            model_dir, root / "head", seed=42, r=8, alpha=96, target_modules=["lm_head"]
        ),
    }  # fmt: skip


async def test_vocab_lora_through_the_engine_matches_peft(tiny, vocab):
    model_dir, adapters = tiny
    use = {"sql": adapters["sql"], "poem": adapters["poem"], **vocab}
    g = random.Random(9)
    choices = [None, "both", "sql", "head", "poem", "both"]
    shared = [g.randrange(3, 250) for _ in range(9)]  # one prompt on every adapter
    reqs = [
        (f"r{i}", [g.randrange(3, 250) for _ in range(g.randint(2, 18))], choices[i % 6], 5)
        for i in range(12)
    ]
    reqs += [(f"s{i}", shared, a, 5) for i, a in enumerate(choices[:5])]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # two slots for four adapters: vocab and plain adapters take turns in the same slots
    async with AsyncEngine(config(model_dir, max_loras=2)) as engine:
        await register(engine, use)
        results = await asyncio.gather(
            *(collect(engine, p, params, a, rid) for rid, p, a, _ in reqs)
        )
        again = [await collect(engine, p, params, a) for _, p, a, _ in reqs[-5:]]
        s = engine.stats()
        assert_idle(engine)
    assert s["adapters"]["gpu_evictions"] > 0
    hf = HFReference(model_dir, use)
    outs = {}
    for (_, prompt, a, n), (tokens, _, _) in zip(reqs + reqs[-5:], results + again, strict=True):
        ref, gaps = hf.greedy(prompt, a, n)
        compare(tokens, ref, gaps)
        if prompt is shared:
            outs[a] = ref
    # the shared prompt's KV blocks are not reused across adapters: each output is its own
    assert outs["both"] != outs[None] and outs["head"] != outs[None]


async def test_vocab_lora_over_http(tiny, vocab):
    model_dir, _ = tiny
    prompt = [5, 17, 99, 3, 42, 8]
    async with AsyncEngine(config(model_dir, kv_cache_bytes=8 << 20)) as engine:
        await engine.add_adapter("both", f"file://{vocab['both']}")
        ids = await http_greedy_ids(engine, "both", prompt, 6)
    ref, gaps = HFReference(model_dir, {"both": vocab["both"]}).greedy(prompt, "both", 6)
    compare(ids, ref, gaps)
