"""One point of the study: build the engine, warm it up, drive the open-loop workload, measure."""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
from loraplex.engine.bench.coldload.adapters import (
    AdapterSet,
    build_model,
    resolve_device,
    write_adapter_set,
)
from loraplex.engine.bench.coldload.bandwidth import pinned_gbps, write_slot_gbps
from loraplex.engine.bench.coldload.collect import Collector, LoadRecord, WriteRecord
from loraplex.engine.bench.coldload.config import PointConfig
from loraplex.engine.bench.coldload.metrics import (
    adapter_intervals,
    inflight_intervals,
    itl_samples,
    request_rows,
)
from loraplex.engine.bench.coldload.progress import Progress
from loraplex.engine.bench.coldload.summary import summarize
from loraplex.engine.bench.coldload.workload import Arrival, make_arrivals
from loraplex.engine.bench.cpu_use import children_cpu, cpu_by_thread, processes_summary, thread_cpu

__all__ = ["PointResult", "run_point", "engine_config"]

WARMUP_NAME = "coldload-warmup"


@dataclass
class PointResult:
    label: str
    values: dict[str, Any]  # the sweep values of this point
    config: PointConfig
    summary: dict[str, Any]
    requests: list[dict[str, Any]]
    loads: list[LoadRecord]
    writes: list[WriteRecord]
    itl: list[tuple[float, float, bool]]  # (t, gap, load in flight), t relative to the start
    inflight: list[tuple[float, float]]  # relative to the start
    engine: dict[str, Any] = field(default_factory=dict)  # capacity report
    start: float = 0.0  # monotonic time of the start of the measurement


def engine_config(
    point: PointConfig, source_kwargs: dict[str, Any], *, cpu_tier: int | None = None
) -> EngineConfig:
    """The engine of a point; ``cpu_tier`` overrides the CPU tier's size (the warm run)."""
    max_len = point.prompt_len.hi + point.output_len.hi + 16
    return EngineConfig(
        model=point.model,
        device=point.device,
        dtype=point.dtype,
        max_loras=point.max_loras,
        max_cpu_loras=max(point.max_cpu_loras, cpu_tier or 0),
        max_lora_rank=point.rank,
        max_num_seqs=point.max_num_seqs,
        max_num_batched_tokens=max(point.max_num_batched_tokens, point.prompt_len.hi),
        max_model_len=max_len,
        kv_cache_bytes=int(point.kv_cache_gb * (1 << 30)) or None,
        cuda_graphs=point.cuda_graphs,
        adapter_eviction=point.adapter_eviction,
        seed=point.seed,
        **(
            {"max_concurrent_loads": point.max_concurrent_loads}
            if point.max_concurrent_loads
            else {}
        ),
        **({"loader_processes": point.loader_processes} if point.loader_processes >= 0 else {}),
        **source_kwargs,
    )


async def _warmup(
    engine: AsyncEngine, point: PointConfig, cfg: dict[str, Any], workdir: Path
) -> None:
    """Compile kernels and capture decode graphs of every batch size before measuring: a
    staggered batch on the base model and one adapter (added statically, removed after)."""
    folder = workdir / "warmup"
    if not (folder / "adapters").is_dir():
        await asyncio.to_thread(
            write_adapter_set, folder, cfg, num=1, rank=point.rank, targets=point.targets
        )
    await engine.add_adapter(WARMUP_NAME, str(folder / "adapters" / "a0"))
    n, vocab, limit = point.max_num_seqs, cfg["vocab_size"], engine.max_model_len
    lo, hi = point.prompt_len.lo, point.prompt_len.hi

    async def one(i: int) -> None:  # prompts across the study's range, outputs 2 .. n+1
        size = min(lo + (hi - lo) * i // max(n - 1, 1), limit - 2)
        params = SamplingParams(
            max_tokens=min(2 + i, limit - size), temperature=0.0, ignore_eos=True
        )
        prompt = [(17 * i + 5 * j) % (vocab - 16) + 16 for j in range(size)]
        async for _ in engine.generate(prompt, params, adapter=WARMUP_NAME if i % 2 else None):
            pass

    await asyncio.gather(*(one(i) for i in range(n)))
    await engine.remove_adapter(WARMUP_NAME)


async def _prestage(engine: AsyncEngine, names: list[str], point: PointConfig) -> None:
    """Bring every adapter of ``names`` into the CPU tier (the warm run): a one-token request
    on each, ``max_loras`` at a time, so the measured trace finds them all staged."""
    gate = asyncio.Semaphore(max(point.max_loras, 1))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def one(name: str) -> None:
        async with gate:
            async for _ in engine.generate([16, 17, 18, 19], params, adapter=name):
                pass

    await asyncio.gather(*(one(n) for n in names))


async def _one(engine: AsyncEngine, arr: Arrival, rid: str, errors: dict[str, str]) -> None:
    params = SamplingParams(max_tokens=arr.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        async for _ in engine.generate(arr.prompt, params, adapter=arr.adapter, request_id=rid):
            pass
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a failed request is data
        errors[rid] = repr(e)


async def run_point(
    point: PointConfig,
    aset: AdapterSet,
    source_kwargs: dict[str, Any],
    workdir: Path,
    *,
    label: str = "run",
    values: dict[str, Any] | None = None,
    progress: bool = True,
    warm: bool = False,
) -> PointResult:
    """Run one engine over the point's workload; the source's environment must be set.

    ``warm``: the yardstick run. The CPU tier is sized to hold every adapter the trace uses,
    and all of them are staged there before the measurement, so the same arrivals are served
    without a cold load (slot writes from the CPU tier still happen)."""
    from loraplex.engine.bench.coldload.adapters import model_config

    cfg = model_config(point)
    model = await asyncio.to_thread(build_model, point, cfg)
    arrivals = make_arrivals(point, aset.names, cfg["vocab_size"])
    used = sorted({a.adapter for a in arrivals if a.adapter is not None})
    device = resolve_device(point.device)
    tier = len(used) + 1 if warm else None
    engine = AsyncEngine(engine_config(point, source_kwargs, cpu_tier=tier), model=model)
    del model
    collector = Collector()
    errors: dict[str, str] = {}
    async with engine:
        collector.attach(engine)
        pinned = await asyncio.to_thread(pinned_gbps, device)
        if point.warmup:
            await _warmup(engine, point, cfg, workdir)
        if warm:
            await _prestage(engine, used, point)
        collector.reset()
        base_stats = dict(engine.stats()["adapters"])
        engine.testing.step_log.clear()
        bar = Progress(len(arrivals), label, enabled=progress)
        tasks: list[asyncio.Task] = []
        lag: list[float] = []
        cpu0 = await asyncio.to_thread(lambda: (thread_cpu(), children_cpu()))
        t0 = time.monotonic()
        for arr in arrivals:
            delay = t0 + arr.t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            lag.append(time.monotonic() - (t0 + arr.t))
            task = asyncio.create_task(_one(engine, arr, f"r{arr.index}", errors))
            task.add_done_callback(lambda _: bar.update())
            tasks.append(task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=point.drain_timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        t_end = time.monotonic()
        cpu1 = await asyncio.to_thread(lambda: (thread_cpu(), children_cpu()))
        bar.close()
        stats = {k: v - base_stats.get(k, 0) for k, v in engine.stats()["adapters"].items()}
        step_log = list(engine.testing.step_log)
        copy = (
            await asyncio.to_thread(write_slot_gbps, engine) if device.startswith("cuda") else None
        )
        capacity = engine.capacity_report()
    requests = list(collector.requests.values())
    intervals = adapter_intervals(collector.loads, collector.writes)
    rows = request_rows(requests, intervals, t0, errors)
    inflight = inflight_intervals(collector.loads, collector.writes)
    itl = itl_samples(requests, inflight)
    summary = summarize(
        rows=rows,
        loads=collector.loads,
        writes=collector.writes,
        itl=itl,
        step_log=step_log,
        stats=stats,
        folder_bytes=aset.folder_bytes,
        pinned_gbps=pinned,
        copy_gbps=copy,
        measured_s=t_end - t0,
        lag=lag,
        t0=t0,
        span_s=max((a.t for a in arrivals), default=0.0),
    )
    # where the CPU went over the arrivals and the drain (cores): the engine's threads, and
    # its child processes (the loader processes, a grammar sandbox)
    summary["cpu"] = {
        "threads": cpu_by_thread(cpu0[0], cpu1[0], t_end - t0),
        "children": processes_summary(cpu0[1], cpu1[1], t_end - t0),
    }
    result = PointResult(
        label=label,
        values=dict(values or {}),
        config=point,
        summary=summary,
        requests=rows,
        loads=list(collector.loads),
        writes=list(collector.writes),
        itl=[(t - t0, d, w) for t, d, w in itl],
        inflight=[(a - t0, b - t0) for a, b in inflight],
        engine=capacity,
        start=t0,
    )
    del engine, collector, requests
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result
