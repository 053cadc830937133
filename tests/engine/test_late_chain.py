"""Late chaining (``late_chain_margin_ms``): while requests wait on cold loads, the step chained
behind the one in flight is planned when a load lands or shortly before the step in flight is
due to end, so that the landing rides the next step. The deadline's arithmetic, the loop's
wait (ended by a wake or by the deadline), and the whole path in a CPU engine with a load made
slow on purpose (on the CPU the engine itself never waits: a launch computes its step)."""

from __future__ import annotations

import asyncio
import collections
import time
from types import SimpleNamespace

import pytest

from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
from loraplex.engine.core_steps import StepOps
from loraplex.engine.executor import StepRecord
from loraplex.engine.lora.manager import AdapterState
from loraplex.engine.server.cli import build_parser
from loraplex.engine.server.launch import config_from_args
from tests.engine.test_async_engine import assert_idle, collect, config, register


def record(gpu_s: float, host_s: float, pipelined: bool = True, graph: bool = True) -> StepRecord:
    """A step whose replay took ``gpu_s``; its period (``seconds``) longer, as if launched late:
    the deadline must not follow it."""
    gpu_ms = gpu_s * 1e3 if graph else None
    return StepRecord(gpu_s * 3, 32, 32, True, False, gpu_ms, host_s, pipelined, 0.0, 0)


def stub_core(
    *, margin=1.5, device="cuda", states=(AdapterState.LOADING,), log=(), last=None, lags=()
):
    waiting = [SimpleNamespace(adapter=SimpleNamespace(state=s)) for s in states]
    waiting.append(SimpleNamespace(adapter=None))  # a base-model request
    executor = SimpleNamespace(
        step_log=collections.deque(log),
        last_result_time=time.perf_counter() if last is None else last,
    )
    return SimpleNamespace(
        plan_lags=collections.deque(lags, maxlen=16),
        config=SimpleNamespace(late_chain_margin_ms=margin, async_scheduling=True),
        device=SimpleNamespace(type=device),
        scheduler=SimpleNamespace(waiting=waiting),
        executor=executor,
    )


STEADY = [record(0.008, 0.001)] * 5 + [record(0.009, 0.002)] + [record(0.007, 0.0005)] * 2


def test_deadline_is_the_expected_end_less_launch_time_and_margin():
    core = stub_core(log=STEADY)
    deadline = StepOps.chain_deadline(core)
    # median replay 8 ms, longest recent launch 2 ms, margin 1.5 ms
    expected = core.executor.last_result_time + 0.008 - 0.002 - 0.0015
    assert deadline == pytest.approx(expected, abs=1e-9)


def test_the_deadline_allows_for_the_recent_plan_lag():
    core = stub_core(log=STEADY, lags=[0.0004, 0.0011, 0.0007])
    expected = core.executor.last_result_time + 0.008 - 0.002 - 0.0011 - 0.0015
    assert StepOps.chain_deadline(core) == pytest.approx(expected, abs=1e-9)
    StepOps.note_plan_lag(core, 0.005)  # e.g. the loop resumed late
    assert StepOps.chain_deadline(core) is None  # 8 - 2 - 5 - 1.5 ms: nothing left to wait


def test_only_the_last_eight_pipelined_graph_steps_count():
    old = [record(0.100, 0.050)] * 20  # long ago: a slow phase
    other = [record(0.030, 0.001, pipelined=False), record(0.030, 0.001, graph=False)]
    other.append(record(0.030, 0.001, pipelined=False))
    # the last eight: three that do not count, then 8, 8, 9, 7, 7 ms (median 8 ms; with the
    # others it would be 8.5)
    core = stub_core(log=old + STEADY[:3] + other + STEADY[3:])
    expected = core.executor.last_result_time + 0.008 - 0.002 - 0.0015
    assert StepOps.chain_deadline(core) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    "kw",
    [
        {"margin": None},  # disabled
        {"device": "cpu"},  # a launch computes its step: nothing is in flight to overlap
        {"states": (AdapterState.CPU, AdapterState.REGISTERED)},  # no load to wait for
        {"states": ()},
        {"log": STEADY[:2]},  # too few pipelined steps for a GPU time
        {"log": [record(0.008, 0.001, graph=False)] * 8},  # eager steps: no replay time
        {"log": STEADY, "last": time.perf_counter() - 1.0},  # the step in flight is overdue
        {"log": [record(0.003, 0.002)] * 8},  # launch + margin longer than a step
    ],
)
def test_no_wait(kw):
    kw.setdefault("log", STEADY)
    assert StepOps.chain_deadline(stub_core(**kw)) is None


class Waits:
    def __init__(self, deadline):
        self.deadline = deadline
        self.noted = []

    def chain_deadline(self):
        return self.deadline

    def note_chain_wait(self, seconds, woken):
        self.noted.append((seconds, woken))


async def test_a_wake_ends_the_wait():
    engine = AsyncEngine(EngineConfig(device="cpu"))
    engine._wake.set()  # a wake from before the wait is already planned for: not this one
    core = Waits(time.perf_counter() + 30.0)
    waiter = asyncio.ensure_future(engine._await_landing(core))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    engine._wake.set()  # a load landed
    due = await asyncio.wait_for(waiter, 10.0)
    assert due < core.deadline  # planning was due when the wake came
    assert len(core.noted) == 1 and core.noted[0][1] is True


async def test_the_deadline_ends_the_wait():
    engine = AsyncEngine(EngineConfig(device="cpu"))
    core = Waits(time.perf_counter() + 0.02)
    assert await engine._await_landing(core) == core.deadline
    assert core.noted and core.noted[0][1] is False
    core = Waits(None)
    assert await engine._await_landing(core) is None
    assert not core.noted


def test_config_and_cli():
    with pytest.raises(ValueError, match="late_chain_margin_ms"):
        EngineConfig(late_chain_margin_ms=-1.0)
    assert EngineConfig().late_chain_margin_ms is None
    parser = build_parser()
    for flag, want in [("3", 3.0), ("0", 0.0), ("-1", None)]:
        args = parser.parse_args(["serve", "--late-chain-margin-ms", flag])
        assert config_from_args(args).late_chain_margin_ms == want
    args = parser.parse_args(["serve"])
    assert config_from_args(args).late_chain_margin_ms is None


async def run_with_slow_load(model_dir, adapters, *, late: bool):
    """Stream 0 decodes; a request on an adapter not yet loaded arrives mid-decode and its
    load takes 0.2 s. ``late``: the core plans chained steps late as it would on CUDA."""
    cfg = config(model_dir, max_loras=2, max_cpu_loras=3, late_chain_margin_ms=1.5)
    greedy = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        await register(engine, {k: adapters[k] for k in ("sql", "poem")})
        await collect(engine, [5, 6], SamplingParams(max_tokens=1), adapter="sql")
        core = engine._engine_core
        manager = engine.testing.adapters
        load = manager._loader

        async def slow_load(v):
            await asyncio.sleep(0.2)
            await load(v)

        manager._loader = slow_load
        if late:

            def deadline():  # as ``chain_deadline`` on CUDA, with a long step in flight
                loading = any(
                    r.adapter is not None and r.adapter.state is AdapterState.LOADING
                    for r in core.scheduler.waiting
                )
                return time.perf_counter() + 5.0 if loading else None

            core.chain_deadline = deadline
        started = asyncio.Event()

        async def first():
            tokens = []
            async for out in engine.generate([9, 8, 7, 6], greedy, adapter="sql"):
                tokens += out.token_ids
                if len(tokens) >= 5:
                    started.set()
            return tokens

        async def cold():
            await started.wait()
            short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            return (await collect(engine, [11, 12, 13], short, adapter="poem"))[0]

        results = await asyncio.gather(first(), cold())
        stats = engine.stats()["late_chain"]
        stats["plan_lags"] = len(core.plan_lags)  # each held-back plan's lag, up to 16
        assert_idle(engine)
    return results, stats


async def test_a_landing_ends_the_wait_in_the_engine(tiny):
    model_dir, adapters = tiny
    plain, plain_stats = await run_with_slow_load(model_dir, adapters, late=False)
    late, stats = await run_with_slow_load(model_dir, adapters, late=True)
    # CPU: the engine never waits itself
    assert plain_stats == {"waits": 0, "woken": 0, "wait_us": 0, "plan_lags": 0}
    assert stats["waits"] >= 1 and stats["woken"] >= 1, stats
    assert stats["plan_lags"] >= 1, stats  # the held-back plan's lag was noted
    assert late == plain  # the same tokens either way
