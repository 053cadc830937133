"""One storm run: adapters, engine, streams, windows; returns the result dict."""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import git_commit
from benchmarks.storm.gcwatch import GcWatch
from benchmarks.storm.model import storm_model, storm_shape, write_adapters
from benchmarks.storm.report import Window, drift_corrected, ends_in, pct, ttft_breakdown
from benchmarks.storm.sustained import prepare, register_at_rate
from benchmarks.storm.threads import GilProfile, cpu_by_thread, thread_cpu
from benchmarks.synthetic import write_model_config
from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
from loraplex.engine.warmup import COMPILES

__all__ = ["run", "idle_slot_writes", "writes_during"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    cfg = storm_shape(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="storm-"))
    model_dir = write_model_config(work / "model", cfg)
    resident = [f"r{i}" for i in range(args.resident)]
    storms = [[f"s{n}_{i}" for i in range(n)] for n in args.storms]
    t0 = time.perf_counter()
    write_adapters(work / "adapters", cfg, resident + [n for s in storms for n in s], args.rank,
                   device, experts=args.expert_lora)  # fmt: skip
    adapter_bytes = (work / "adapters" / resident[0] / "adapter_model.safetensors").stat().st_size
    steady = prepare(args, cfg, work)
    print(f"adapters written in {time.perf_counter() - t0:.1f} s ({adapter_bytes / 1e6:.0f} MB each)",
          flush=True)  # fmt: skip
    model = storm_model(cfg, args, device)
    moe = model.cfg.moe is not None
    config = EngineConfig(
        model=str(model_dir),
        device=device,
        dtype="float32" if device == "cpu" else "bfloat16",
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.rank,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len + args.max_tokens + 64,
        kv_cache_bytes=args.kv_cache_gb << 30 if args.kv_cache_gb else None,
        local_roots=(str(work / "adapters"), str(work / "sustained")),
        adapter_cache_dir=str(work / "staging"),
        **({"loader_processes": args.loader_processes} if args.loader_processes is not None
           else {}),
        **({"max_concurrent_loads": args.max_concurrent_loads}
           if args.max_concurrent_loads is not None else {}),
    )  # fmt: skip
    compiles = COMPILES  # the engine's own watch: every Triton compile with its time
    compiles.install()
    g = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab - 1, (n,), generator=g).tolist()

    async with AsyncEngine(config, model=model) as engine:
        t_ready = time.perf_counter()
        compiles_at_start = len(compiles.events)
        lags: list[tuple[float, float]] = []  # the engine's loop-lag samples: (time, lag s)
        loads: list[dict] = []
        writes: list[tuple[float, dict]] = []

        def on_event(ev: str, d: dict) -> None:
            if ev == "adapter_load":
                loads.append({**d, "t": time.perf_counter()})
            elif ev == "slot_write":
                writes.append((time.perf_counter(), d))
            elif ev == "loop_lag":
                lags.append((time.perf_counter(), d["lag_s"]))

        engine.subscribe(on_event)
        gcw = GcWatch()  # (after start-up: the engine froze what it built)
        gcw.start()
        for name in resident:
            await engine.add_adapter(name, str(work / "adapters" / name))
        times: list[list[float]] = [[] for _ in range(args.streams)]
        stop = asyncio.Event()

        async def stream(i: int) -> None:
            adapter = (
                None if i % (len(resident) + 1) == 0 else resident[i % (len(resident) + 1) - 1]
            )
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            gen = engine.generate(prompt(args.prompt_len), params, adapter=adapter)
            try:
                async for _ in gen:
                    times[i].append(time.perf_counter())
                    if stop.is_set():
                        break
            finally:
                await gen.aclose()

        streams = [asyncio.create_task(stream(i)) for i in range(args.streams)]
        # wait until every stream decodes (prefills done), then a quiet window
        while min(len(t) for t in times) < 8:
            for t in streams:
                if t.done():  # a stream that failed (or ended) before the windows
                    t.result()
                    raise RuntimeError("a running stream ended before the storm windows")
            await asyncio.sleep(0.05)
        windows: list[Window] = []

        async def window(name: str, coro=None, seconds: float = 0.0) -> Window:
            prof = None
            if args.profile and coro is not None:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                prof = GilProfile(Path(args.profile) / f"gil-{name.replace(' ', '-')}.txt")
                if prof.start():
                    await asyncio.sleep(0.5)  # py-spy attaches
            # NOTE: off the event loop: a /proc scan of ~100 threads takes 3-10 ms, and on the
            # loop it stalled the streams right at each window's start (the window's max gap)
            cpu0 = await asyncio.to_thread(thread_cpu)
            w = Window(name, time.perf_counter())
            if coro is not None:
                w.info = await coro
            if seconds:
                await asyncio.sleep(seconds)
            w.t1 = time.perf_counter()
            cpu1 = await asyncio.to_thread(thread_cpu)
            w.info["thread_cpu"] = cpu_by_thread(cpu0, cpu1, w.t1 - w.t0)
            if prof is not None and (err := prof.stop()):
                print(f"  py-spy: {err}", flush=True)
            windows.append(w)
            print(f"  window {name}: {w.t1 - w.t0:.2f} s", flush=True)
            return w

        await window("quiet", seconds=args.quiet_s)
        short = SamplingParams(max_tokens=args.storm_tokens, temperature=0.0, ignore_eos=True)

        async def register(names: list[str]) -> dict:
            t = time.perf_counter()
            await asyncio.gather(
                *(engine.add_adapter(n, str(work / "adapters" / n)) for n in names)
            )
            return {"seconds": time.perf_counter() - t}

        async def requests(names: list[str]) -> dict:
            async def one(n: str) -> tuple[float, float]:
                t = time.perf_counter()
                first = None
                async for _ in engine.generate(prompt(args.storm_prompt_len), short, adapter=n):
                    first = first or time.perf_counter()
                return (first or t) - t, time.perf_counter() - t

            t0 = time.perf_counter()
            res = await asyncio.gather(*(one(n) for n in names))
            ttft = [r[0] for r in res]
            return {
                "ttft_p50_s": statistics.median(ttft),
                "ttft_max_s": max(ttft),
                "seconds": max(r[1] for r in res),
                "sent_first": [(n, t0, t0 + r[0]) for n, r in zip(names, res, strict=True)],
            }

        for n, names in zip(args.storms, storms, strict=True):
            # add_adapter packs each image while the CPU tier has room: those loads land in
            # the register window, the rest (and every slot write) in the requests window
            nloads = len(loads)
            w = await window(f"register {n}", register(names))
            w.info["loads"] = loads[nloads:]
            await window(f"settle {n}", seconds=args.settle_s)
            nloads = len(loads)
            w = await window(f"requests {n}", requests(names))
            w.info["loads"] = loads[nloads:]
            await window(f"after {n}", seconds=args.settle_s)
        if steady is not None:  # the CPU tier emptied of the storms' adapters first
            for name in (n for names in storms for n in names):
                await engine.remove_adapter(name)
            await window("before sustained", seconds=args.settle_s)
            nloads = len(loads)
            keep = max(1, args.max_cpu_loras // 2)
            w = await window(
                f"sustained {args.sustained[0]:g}/s",
                register_at_rate(engine, steady, args.sustained[0], keep),
            )
            w.info["loads"] = loads[nloads:]
        stop.set()
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        stats = engine.stats()
        gcw.stop()
        step_log = list(engine.testing.step_log)
        all_loads = list(loads)
        # (the q/k/v/o re-pack below is the dense shape's question)
        idle_writes = idle_slot_writes(engine) if device == "cuda" and not moe else {}
    rows = []
    for w in windows:
        gaps = [b - a for ts in times for a, b in itertools.pairwise(ts) if ends_in(w, a, b)]
        lag = [s for t, s in lags if w.t0 <= t <= w.t1]
        comp = [name for t, name in compiles.events if w.t0 <= t <= w.t1]
        row = {
            "window": w.name,
            "seconds": w.t1 - w.t0,
            "gaps": len(gaps),
            "gap_p50_ms": pct(gaps, 50) * 1e3,
            "gap_p99_ms": pct(gaps, 99) * 1e3,
            "gap_max_ms": max(gaps, default=float("nan")) * 1e3,
            "loop_lag_p99_ms": pct(lag, 99) * 1e3,
            "loop_lag_max_ms": max(lag, default=float("nan")) * 1e3,
            "compiles": len(comp),
            "compiled": sorted(set(comp)),
        }
        steps = [e for e in step_log if w.t0 <= e.t_end <= w.t1]
        row["gc"] = gcw.window(w.t0, w.t1)
        # delivery: a stream's token reached it this long after the last step's tokens
        # reached the host (the loop's apply and hand-over; late when the loop is busy)
        ends = [e.t_end for e in step_log]
        late = [
            t - ends[k - 1]
            for ts in times for t in ts
            if w.t0 <= t <= w.t1 and (k := bisect.bisect_right(ends, t)) > 0
        ]  # fmt: skip
        row["delivery_p50_ms"] = pct(late, 50) * 1e3
        row["delivery_p99_ms"] = pct(late, 99) * 1e3
        row["delivery_max_ms"] = max(late, default=float("nan")) * 1e3
        row["slowest_steps"] = [
            {
                **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in e._asdict().items()},
                "writes_in_flight": writes_during(writes, e.t_end - e.seconds, e.t_end),
            }
            for e in sorted(steps, key=lambda e: -e.seconds)[:6]
        ]
        for k in ("ttft_p50_s", "ttft_max_s", "seconds", "thread_cpu", "sustained"):
            if k in w.info:
                row[k] = w.info[k]
        if "sent_first" in w.info and steps:
            step_s = statistics.median(e.seconds for e in steps)
            row["ttft_breakdown"] = ttft_breakdown(
                w.info["sent_first"], w.info.get("loads", []), writes, step_s
            )
        if "loads" in w.info and w.info["loads"]:
            ok = [d for d in w.info["loads"] if d.get("ok")]
            row["loads"], row["failed_loads"] = len(w.info["loads"]), len(w.info["loads"]) - len(ok)
            for stage in ("fetch", "verify", "preflight", "stage"):
                vals = [d["timings"].get(stage, 0.0) for d in ok]
                row[f"{stage}_p50_ms"] = pct(vals, 50) * 1e3 if vals else None
        ws = [d for t, d in writes if w.t0 <= t <= w.t1 and d.get("h2d_gpu_s")]
        if ws:
            row["slot_write_mb"] = statistics.median(d["copy_bytes"] for d in ws) / 1e6
            row["slot_write_gbps_p50"] = pct(
                [d["copy_bytes"] / d["h2d_gpu_s"] / 1e9 for d in ws], 50
            )
            row["slot_write_gbps_min"] = min(d["copy_bytes"] / d["h2d_gpu_s"] / 1e9 for d in ws)
            row["h2d_copy_gbps_p50"] = pct(
                [d["copy_bytes"] / d["h2d_copy_s"] / 1e9 for d in ws if d.get("h2d_copy_s")], 50
            )
        # the largest gaps of running streams, with the steps that ended around them
        big = sorted(
            ((b - a, i, a, b) for i, ts in enumerate(times) for a, b in itertools.pairwise(ts)
             if ends_in(w, a, b)),
            reverse=True,
        )[:3]  # fmt: skip
        row["largest_gaps"] = [
            {
                "gap_ms": g * 1e3, "stream": i,
                "steps": [
                    {k: (round(v, 5) if isinstance(v, float) else v)
                     for k, v in e._asdict().items()}
                    for e in step_log if a - 0.02 <= e.t_end <= b + 0.005
                ],
            }
            for g, i, a, b in big
        ]  # fmt: skip
        rows.append(row)
    drift_corrected(rows, times, windows)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "commit": args.commit or git_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
        "shape": {
            "layers": cfg["num_hidden_layers"],
            "moe": moe,
            "adapter_mb": adapter_bytes / 1e6,
        },
        "startup_s": t_ready - t0,
        "compiles_during_startup": compiles_at_start,
        "compiles_while_serving": len(compiles.events) - compiles_at_start,
        "rows": rows,
        "adapter_stats": stats.get("adapters"),
        "idle_slot_writes": idle_writes,
        # seconds since the first window: step ends and durations, loads done, slot writes landed
        "timeline": {
            "t0": windows[0].t0,
            "windows": [(w.name, w.t0 - windows[0].t0, w.t1 - windows[0].t0) for w in windows],
            "steps": [
                (e.t_end - windows[0].t0, e.seconds * 1e3, e.rows, e.tokens, e.slot_writes)
                for e in step_log
                if e.t_end >= windows[0].t0
            ],
            "loads": [d["t"] - windows[0].t0 for d in all_loads if d["t"] >= windows[0].t0],
            "writes": [t - windows[0].t0 for t, _ in writes if t >= windows[0].t0],
        },
    }


def writes_during(writes: list[tuple[float, dict]], t0: float, t1: float) -> list[dict]:
    """The slot writes whose interval from issue to landing (host clock: the ``slot_write``
    event's time less its ``h2d_s``) overlaps a step's (t0, t1): each one's start and end
    relative to the step's start, and its GPU time (transfer + scatter), in ms. A slow step
    with a write in flight on the side stream is told apart from one without."""
    out = []
    for t, d in writes:
        a = t - (d.get("h2d_s") or 0.0)
        if a < t1 and t > t0:
            out.append({
                "from_ms": round((a - t0) * 1e3, 2), "to_ms": round((t - t0) * 1e3, 2),
                "gpu_ms": round((d.get("h2d_gpu_s") or 0.0) * 1e3, 2),  # (None on the CPU)
            })  # fmt: skip
    return out


def idle_slot_writes(engine: AsyncEngine) -> dict[str, float]:
    """GB/s of whole slot writes (transfer + scatter) with the GPU otherwise idle, for a
    resident all-module adapter (84 MB at the 8B shape, from its host-pool region) and its
    q/k/v/o part (27 MB), next to a plain pinned copy."""
    from loraplex.engine.adapters.parse import LoRAAdapter
    from loraplex.engine.bench.coldload.bandwidth import measure_slot_write
    from loraplex.engine.model.lora.slot_image import pack_adapter

    internals = engine.testing
    model = internals.executor.model
    torch.cuda.synchronize()
    slots = internals.adapters.slots
    v = next((x for x in slots.resident if slots.is_ready(x) and x.adapter is not None), None)
    if v is None:
        return {}
    slot = slots.slot_of(v)
    full = v.adapter.image
    attn = LoRAAdapter(
        v.name, "", v.adapter.config,
        {k: w for k, w in v.adapter.weights.items() if k[1] in ("q_proj", "k_proj", "v_proj", "o_proj")},
    )  # fmt: skip
    small = pack_adapter(attn, engine.config.max_lora_rank, pin=True)
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    pinned = 5 * src.numel() / (time.perf_counter() - t0) / 1e9
    out = {
        "pinned_gbps": pinned,
        "full_mb": full.nbytes / 1e6,
        "full_gbps": measure_slot_write(model, full, slot=slot),
        "qkvo_mb": small.nbytes / 1e6,
        "qkvo_gbps": measure_slot_write(model, small, slot=slot),
        # into a slot that held another layout: the MLP regions zero-filled as well
        "qkvo_fill_gbps": measure_slot_write(model, small, slot=slot, zero_fill=True),
    }
    measure_slot_write(model, full, repeats=1, slot=slot)  # (its own content back)
    torch.cuda.synchronize()
    return out
