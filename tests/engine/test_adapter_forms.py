"""Adapter forms beyond plain LoRA through AsyncEngine (cold loads, CPU tier, slot writes and
re-writes under eviction, prefix-cache identity) against HF PEFT, and their typed refusals."""

from __future__ import annotations

import asyncio
import random

import pytest
from safetensors.torch import load_file

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import AdapterCompositionError, AdapterFormatError
from tests.helpers.adapters import make_dora_adapter
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.models import copy_adapter
from tests.helpers.peft_oracle import HFReference, compare


@pytest.fixture(scope="module")
def dora(tiny, tmp_path_factory):
    model_dir, _ = tiny
    root = tmp_path_factory.mktemp("forms")
    return make_dora_adapter(
        model_dir, root / "dora", seed=31, r=4, alpha=8,
        target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"],
    )  # fmt: skip


async def test_dora_through_the_engine_matches_peft(tiny, dora):
    model_dir, adapters = tiny
    use = {"sql": adapters["sql"], "poem": adapters["poem"], "dora": dora}
    g = random.Random(8)
    choices = [None, "dora", "sql", "dora", "poem"]
    reqs = [
        (f"r{i}", [g.randrange(3, 250) for _ in range(g.randint(2, 18))], choices[i % 5], 5)
        for i in range(10)
    ]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # two slots for three adapters: DoRA and plain adapters take turns in the same slots
    async with AsyncEngine(config(model_dir, max_loras=2)) as engine:
        await register(engine, use)
        results = await asyncio.gather(
            *(collect(engine, p, params, a, rid) for rid, p, a, _ in reqs)
        )
        again = [await collect(engine, p, params, a) for _, p, a, _ in reqs[:5]]
        s = engine.stats()
        assert_idle(engine)
    assert s["adapters"]["gpu_evictions"] > 0
    hf = HFReference(model_dir, use)
    # the second round runs on slots re-written after evictions (DoRA <-> plain)
    for (_, prompt, a, n), (tokens, _, _) in zip(reqs + reqs[:5], results + again, strict=True):
        ref, gaps = hf.greedy(prompt, a, n)
        compare(tokens, ref, gaps)


async def test_dora_without_magnitudes_is_refused_at_registration(tiny, dora, tmp_path):
    model_dir, _ = tiny
    tensors = load_file(dora / "adapter_model.safetensors")
    bad = copy_adapter(
        dora, tmp_path / "bad", tensors={k: v for k, v in tensors.items() if "magnitude" not in k}
    )
    async with AsyncEngine(config(model_dir)) as engine:
        with pytest.raises(AdapterFormatError, match="no lora_magnitude_vector"):
            await engine.add_adapter("bad", f"file://{bad}")
        assert engine.list_adapters() == []
        assert engine.stats()["adapter_refs"] == {}


async def test_dora_adapters_are_not_composed(tiny, dora):
    model_dir, adapters = tiny
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, {"sql": adapters["sql"], "dora": dora})
        with pytest.raises(AdapterCompositionError, match="DoRA"):
            await collect(engine, [1, 2], SamplingParams(max_tokens=2), [("sql", 1), ("dora", 1)])
        assert engine.stats()["adapters"]["loads"] == 0


async def test_dora_request_joining_its_slot_write_is_exact(tiny, dora):
    """A DoRA request admitted mid-decode into the chained step that writes its slot (the
    step waits for the write on the device) gets its row scale in that very step."""
    model_dir, adapters = tiny
    use = {"sql": adapters["sql"], "poem": adapters["poem"], "dora": dora}
    one = SamplingParams(max_tokens=1)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = config(model_dir, max_loras=2, max_cpu_loras=3, async_scheduling=True)
    async with AsyncEngine(cfg) as engine:
        await register(engine, use)
        for name in ("sql", "dora", "poem", "sql"):  # dora ends in the CPU tier, slotless
            await collect(engine, [5, 6], one, name)
        assert "dora" not in engine.stats()["gpu_resident"]
        engine.testing.step_log.clear()
        started = asyncio.Event()

        async def first():
            tokens = []
            async for out in engine.generate([9, 8, 7, 6], greedy, adapter="sql"):
                tokens += out.token_ids
                if len(tokens) >= 3:
                    started.set()
            return tokens

        async def late():
            await started.wait()
            return (await collect(engine, [30, 31, 32, 33, 34], greedy, "dora"))[0]

        _, tokens = await asyncio.gather(first(), late())
        joined = sum(1 for e in engine.testing.step_log if e.pipelined and not e.decode)
        assert_idle(engine)
    assert joined > 0, "the DoRA request did not join a chained step"
    ref, gaps = HFReference(model_dir, use).greedy([30, 31, 32, 33, 34], "dora", 12)
    compare(tokens, ref, gaps)
