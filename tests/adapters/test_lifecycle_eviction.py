"""The engine's adapter eviction policy (``EngineConfig.adapter_eviction``, issue 41) on the tiny
model: one scripted request order, two GPU slots, and the victim each policy picks; a removed
adapter leaves neither tier's policy holding it."""

from __future__ import annotations

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from tests.helpers.lifecycle import PROMPT, assert_idle, collect, config, derived_adapter

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("policy", "survivor"), [("lru", "once"), ("gdf", "hot")])
async def test_policy_picks_the_gpu_victim(tiny, tmp_path, policy: str, survivor: str):
    model_dir, adapters = tiny
    # three adapters of the same shapes (the same load and slot-write cost, measured)
    src = {
        "hot": adapters["sql"],
        "once": derived_adapter(adapters["sql"], tmp_path / "once", seed=1),
        "new": derived_adapter(adapters["sql"], tmp_path / "new", seed=2),
    }
    cfg = config(model_dir, max_loras=2, max_cpu_loras=3, adapter_eviction=policy)
    async with AsyncEngine(cfg) as engine:
        for name, path in src.items():
            await engine.add_adapter(name, f"file://{path}")
        # hot: eight requests; then once: one, the most recent; then new needs a slot
        for name in ["hot"] * 8 + ["once"]:
            await collect(engine, PROMPT, GREEDY, adapter=name)
        assert sorted(engine.stats()["gpu_resident"]) == ["hot", "once"]
        await collect(engine, PROMPT, GREEDY, adapter="new")
        stats = engine.stats()
        # lru gives up hot (used longest ago); gdf keeps it (eight uses against one)
        assert sorted(stats["gpu_resident"]) == sorted(["new", survivor])
        assert stats["adapters"]["gpu_evictions"] == 1
        assert stats["adapters"]["cpu_evictions"] == 0
        assert_idle(engine)
        adapters_side = engine.testing.adapters
        host, gpu = adapters_side.registry.eviction, adapters_side.slots.eviction
        assert host.name == gpu.name == policy and host is not gpu
        for name in src:
            await engine.remove_adapter(name)
        assert adapters_side.registry.versions() == []
        assert len(host) == 0 and len(gpu) == 0
