"""Late planning of a chained step while an adapter load is about to land: the clock
(engine/late_plan.py), the scheduler's condition, and clients' tokens unchanged by it."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.late_plan import LatePlan
from loraplex.engine.lora.manager import AdapterState
from tests.engine.test_async_engine import assert_idle, collect, config, register
from tests.engine.test_scheduler_unit import make, submit
from tests.lora.test_manager_unit import loaded
from tests.lora.test_manager_unit import register as register_version


def test_clock_holds_until_the_running_step_nearly_ends():
    late = LatePlan(0.003)
    assert late.hold_s(0.0) == 0.0  # nothing runs
    late.first(1.000)
    late.next(1.010)  # one period (10 ms) seen: not enough to trust
    assert late.hold_s(1.011) == 0.0
    late.next(1.016)  # 6 ms: the shortest period counts
    assert late.hold_s(1.017) == pytest.approx(1.016 + 0.006 - 0.003 - 1.017)
    assert late.hold_s(1.020) == 0.0  # past the deadline: plan now
    late.next(1.030)  # a slow (14 ms) step does not stretch the estimate
    assert late.hold_s(1.030) == pytest.approx(0.003)
    assert LatePlan(None).hold_s(0.0) == 0.0


def test_scheduler_holds_only_for_loads_in_flight():
    s, _, adapters, _ = make()
    assert not s.loads_landing()  # nothing waits
    submit(s, "base")
    assert not s.loads_landing()  # a base request needs no load
    v = register_version(adapters, "a")
    v.state = AdapterState.LOADING
    submit(s, "on-a", v=v)
    assert s.loads_landing()
    ready = loaded(adapters, "b")
    submit(s, "on-b", v=ready)
    assert not s.loads_landing()  # one is loaded and has no slot yet: plan now
    assert adapters.assign_slot(ready) is not None
    assert s.loads_landing()  # its write is planned; the load of a still lands


async def test_tokens_unchanged_with_loads_landing_mid_decode(tiny):
    """Streams decode while requests arrive on adapters not loaded yet: the same greedy tokens
    whether the chained plans are held for the loads or made at once."""
    model_dir, adapters = tiny
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run(margin):
        cfg = config(model_dir, max_loras=4, max_cpu_loras=4, late_plan_margin_s=margin)
        async with AsyncEngine(cfg) as engine:
            await register(engine, adapters)
            started = asyncio.Event()

            async def long(i):
                out = []
                async for o in engine.generate([7 + i, 8, 9], greedy, adapter=None):
                    out += o.token_ids
                    if len(out) >= 4:
                        started.set()
                return out

            async def storm(name, k):
                await started.wait()
                return (await collect(engine, [30 + k, 31, 32], short, adapter=name))[0]

            res = await asyncio.gather(
                *(long(i) for i in range(3)),
                *(storm(n, k) for k, n in enumerate(adapters)),
            )
            holds = engine.stats()["late_plan_holds"]
            assert_idle(engine)
        return res, holds

    (held, holds), (at_once, none) = await run(0.0), await run(None)
    assert holds > 0 and none == 0
    assert held == at_once
