"""Cold-load storm: do running streams keep their pace while a burst of adapters loads?

Scenario (issue "storm-proof loads"): ``--streams`` requests decode steadily on the base model
and ``--resident`` adapters; then, for each storm size N in ``--storms``, N new adapters
(distinct files, local source) are registered at once with ``add_adapter`` (fetch + sha256 +
preflight), and then one short request is sent on each of them at once (stage, slot write,
prefill). The running streams' inter-token gaps are measured per window (quiet, registration,
requests, after), next to the asyncio loop's lag, Triton compiles and the storm requests' TTFT
split by load stage.

    python -m benchmarks.storm                      # H200: Llama-3-8B shape, 32 streams, 24 + 64
    python -m benchmarks.storm --smoke              # CPU: tiny model, a few seconds

Gaps are measured where a client sees them: the time between two consecutive outputs of one
stream, read by the stream's consumer on the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.coldload.adapters import TINY
from benchmarks.synthetic import LLAMA3_8B, random_model, write_adapter, write_model_config
from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams


def write_adapters(root: Path, cfg: dict, names: list[str], rank: int, device: str) -> None:
    """Distinct rank-``rank`` all-module bf16 PEFT adapters, one folder per name (random
    weights drawn on ``device``: writing 88 x 84 MB from CPU randn would take minutes)."""
    for i, name in enumerate(names):
        write_adapter(root / name, cfg, rank=rank, seed=1234 + i, device=device)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


@dataclass
class Window:
    name: str
    t0: float
    t1: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


class LagProbe:
    """How late a due callback runs on the event loop (sampled every ``interval`` s)."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (perf_counter, lag s)
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.interval
            await asyncio.sleep(self.interval)
            now = time.perf_counter()
            self.samples.append((now, max(0.0, now - due)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class CompileCounter:
    """Triton kernels compiled (or loaded from its disk cache) in this process, with times."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []
        try:
            from triton import knobs
        except ImportError:  # triton < 3.4 or absent: nothing to count
            return
        prev = knobs.runtime.jit_post_compile_hook

        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
            self.events.append((time.perf_counter(), getattr(fn, "name", "?")))
            if prev is not None:
                return prev(
                    key=key, repr=repr, fn=fn, compile=compile,
                    is_manual_warmup=is_manual_warmup, already_compiled=already_compiled,
                )  # fmt: skip
            return None

        knobs.runtime.jit_post_compile_hook = hook


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    cfg = dict(TINY if args.smoke else LLAMA3_8B)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="storm-"))
    model_dir = write_model_config(work / "model", cfg)
    resident = [f"r{i}" for i in range(args.resident)]
    storms = [[f"s{n}_{i}" for i in range(n)] for n in args.storms]
    t0 = time.perf_counter()
    write_adapters(work / "adapters", cfg, resident + [n for s in storms for n in s], args.rank,
                   device)  # fmt: skip
    print(f"adapters written in {time.perf_counter() - t0:.1f} s", flush=True)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = random_model(
        cfg, max_loras=args.max_loras, max_lora_rank=args.rank, device=device, dtype=dtype
    )
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
        local_roots=(str(work / "adapters"),),
        adapter_cache_dir=str(work / "staging"),
        max_concurrent_loads=args.max_concurrent_loads,
        **({"loader_processes": args.loader_processes} if args.loader_processes is not None
           else {}),
    )  # fmt: skip
    compiles = CompileCounter()
    g = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab - 1, (n,), generator=g).tolist()

    async with AsyncEngine(config, model=model) as engine:
        t_ready = time.perf_counter()
        compiles_at_start = len(compiles.events)
        loads: list[dict] = []
        writes: list[tuple[float, dict]] = []

        def on_event(ev: str, d: dict) -> None:
            if ev == "adapter_load":
                loads.append({**d, "t": time.perf_counter()})
            elif ev == "slot_write":
                writes.append((time.perf_counter(), d))

        engine.subscribe(on_event)
        for name in resident:
            await engine.add_adapter(name, str(work / "adapters" / name))
        probe = LagProbe()
        probe.start()
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
            await asyncio.sleep(0.05)
        windows: list[Window] = []

        async def window(name: str, coro=None, seconds: float = 0.0) -> Window:
            w = Window(name, time.perf_counter())
            if coro is not None:
                w.info = await coro
            if seconds:
                await asyncio.sleep(seconds)
            w.t1 = time.perf_counter()
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

            res = await asyncio.gather(*(one(n) for n in names))
            ttft = [r[0] for r in res]
            return {
                "ttft_p50_s": statistics.median(ttft),
                "ttft_max_s": max(ttft),
                "seconds": max(r[1] for r in res),
            }

        for n, names in zip(args.storms, storms, strict=True):
            await window(f"register {n}", register(names))
            await window(f"settle {n}", seconds=args.settle_s)
            nloads = len(loads)
            w = await window(f"requests {n}", requests(names))
            w.info["loads"] = loads[nloads:]
            await window(f"after {n}", seconds=args.settle_s)
        stop.set()
        for t in streams:
            t.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await probe.stop()
        stats = engine.stats()
        step_log = list(engine.core.step_log)
        all_loads = list(loads)
        idle_writes = idle_slot_writes(engine) if device == "cuda" else {}
    rows = []
    for w in windows:
        gaps = [b - a for ts in times for a, b in itertools.pairwise(ts) if a >= w.t0 and b <= w.t1]
        lag = [s for t, s in probe.samples if w.t0 <= t <= w.t1]
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
        row["slowest_steps"] = [
            {k: (round(v, 5) if isinstance(v, float) else v) for k, v in e._asdict().items()}
            for e in sorted(steps, key=lambda e: -e.seconds)[:6]
        ]
        for k in ("ttft_p50_s", "ttft_max_s", "seconds"):
            if k in w.info:
                row[k] = w.info[k]
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
             if a >= w.t0 and b <= w.t1),
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
        "commit": args.commit or _commit(),
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
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


def plot_timeline(result: dict[str, Any], path: str) -> None:
    """Step durations over the run (the gaps every running stream sees), load windows shaded,
    loads finishing and slot writes landing marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(12, 4))
    for name, a, b in tl["windows"]:
        if name.startswith(("register", "requests")):
            ax.axvspan(a, b, color="tab:orange" if name.startswith("requests") else "tab:blue",
                       alpha=0.12)  # fmt: skip
            ax.text(a, 1.02, name, transform=ax.get_xaxis_transform(), fontsize=8)
    steps = tl["steps"]
    ax.plot([x[0] for x in steps], [x[1] for x in steps], lw=0.6, color="black", label="step (ms)")
    for t in tl["loads"]:
        ax.axvline(t, ymax=0.05, color="tab:green", lw=0.6)
    for t in tl["writes"]:
        ax.axvline(t, ymin=0.95, color="tab:red", lw=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("seconds (green ticks: loads staged; red ticks: slot writes landed)")
    ax.set_ylabel("step interval (ms)")
    ax.set_title(f"cold-load storm, {result['device']}, commit {result['commit']}", pad=16)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def idle_slot_writes(engine: AsyncEngine) -> dict[str, float]:
    """GB/s of whole slot writes (transfer + scatter) with the GPU otherwise idle, for a
    resident all-module adapter (84 MB at the 8B shape, from its host-pool region) and its
    q/k/v/o part (27 MB), next to a plain pinned copy."""
    from loraplex.engine.lora.adapter import LoRAAdapter
    from loraplex.engine.lora.slots import measure_slot_write
    from loraplex.engine.lora.staging import pack_adapter, packed_for

    core = engine.core
    torch.cuda.synchronize()
    v = next((x for x in core.adapters.resident if x.slot_ready and x.adapter is not None), None)
    if v is None:
        return {}
    full = packed_for(v.adapter)
    attn = LoRAAdapter(
        v.name, "", v.adapter.config,
        {k: w for k, w in v.adapter.weights.items() if k[1] in ("q_proj", "k_proj", "v_proj", "o_proj")},
    )  # fmt: skip
    small = pack_adapter(attn, core.config.max_lora_rank, pin=True)
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
        "full_gbps": measure_slot_write(core.model, full, slot=v.slot),
        "qkvo_mb": small.nbytes / 1e6,
        "qkvo_gbps": measure_slot_write(core.model, small, slot=v.slot),
    }
    measure_slot_write(core.model, full, repeats=1, slot=v.slot)  # (its own content back)
    torch.cuda.synchronize()
    return out


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def drift_corrected(rows: list[dict], times: list[list[float]], windows: list[Window]) -> None:
    """Add ratios of each load window to the quiet window just before it, with the decode
    step's slow drift taken out: a step reads more KV as contexts grow (~+8 % per 500 tokens
    at 32 streams of the 8B shape), so a later window is slower even without loads. Each gap
    is scaled by p50(before) / trend(t), the trend a line through the p50s of the quiet
    windows before and after it."""
    by_name = {r["window"]: r for r in rows}
    order = [w.name for w in windows]
    for i, w in enumerate(windows):
        if not w.name.startswith(("register", "requests")):
            continue
        before, after = windows[i - 1], windows[i + 1] if i + 1 < len(windows) else None
        qb = by_name[before.name]
        tb, pb = (before.t0 + before.t1) / 2, qb["gap_p50_ms"]
        if after is not None and by_name[after.name]["gaps"]:
            ta, pa = (after.t0 + after.t1) / 2, by_name[after.name]["gap_p50_ms"]
        else:
            ta, pa = tb + 1.0, pb

        def trend(t: float, tb=tb, pb=pb, ta=ta, pa=pa) -> float:
            return pb + (pa - pb) * (t - tb) / (ta - tb)

        norm = [
            (b - a) * 1e3 * pb / trend((a + b) / 2)
            for ts in times
            for a, b in itertools.pairwise(ts)
            if a >= w.t0 and b <= w.t1
        ]
        row = by_name[w.name]
        row["reference"] = before.name
        row["p99_vs_quiet"] = pct(norm, 99) / qb["gap_p99_ms"] if norm else float("nan")
        row["max_vs_quiet_p50"] = max(norm) / pb if norm else float("nan")
        row["raw_p99_vs_quiet"] = row["gap_p99_ms"] / qb["gap_p99_ms"]
        row["raw_max_vs_quiet_p50"] = row["gap_max_ms"] / pb
    assert order  # (windows keep their order)


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"{result['date']}, commit {result['commit']}, {result['device']}; "
        f"compiles while serving: {result['compiles_while_serving']}",
        "",
        "| window | s | gaps | gap p50 / p99 / max (ms) | p99 / quiet p99 | max / quiet p50 "
        "| (raw) | loop lag p99 / max (ms) | compiles | TTFT p50 / max (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ttft = f"{r['ttft_p50_s']:.2f} / {r['ttft_max_s']:.2f}" if "ttft_p50_s" in r else ""
        ratios = raw = ""
        if "p99_vs_quiet" in r:
            ratios = f"{r['p99_vs_quiet']:.3f} | {r['max_vs_quiet_p50']:.2f}"
            raw = f"{r['raw_p99_vs_quiet']:.2f} / {r['raw_max_vs_quiet_p50']:.2f}"
        else:
            ratios = " | "
        lines.append(
            f"| {r['window']} | {r['seconds']:.1f} | {r['gaps']} | {r['gap_p50_ms']:.2f} / "
            f"{r['gap_p99_ms']:.2f} / {r['gap_max_ms']:.2f} | {ratios} | {raw} | "
            f"{r['loop_lag_p99_ms']:.2f} / {r['loop_lag_max_ms']:.2f} | {r['compiles']} | {ttft} |"
        )
    w = result.get("idle_slot_writes") or {}
    if w:
        lines += ["", (
            f"Idle slot writes (transfer + scatter): {w['full_mb']:.0f} MB at {w['full_gbps']:.1f}"
            f" GB/s ({w['full_gbps'] / w['pinned_gbps']:.0%} of pinned {w['pinned_gbps']:.1f}),"
            f" {w['qkvo_mb']:.0f} MB at {w['qkvo_gbps']:.1f} GB/s "
            f"({w['qkvo_gbps'] / w['pinned_gbps']:.0%})"
        )]  # fmt: skip
    stages = [r for r in rows if r.get("stage_p50_ms") is not None]
    if stages:
        lines += ["", "Load stages of the storm requests (p50 ms): " + "; ".join(
            f"{r['window']}: fetch {r['fetch_p50_ms']:.0f}, verify {r['verify_p50_ms']:.0f}, "
            f"preflight {r['preflight_p50_ms']:.0f}, stage {r['stage_p50_ms']:.0f}; slot "
            f"writes of {r.get('slot_write_mb', 0):.0f} MB at {r.get('slot_write_gbps_p50', 0):.1f}"
            f" GB/s p50 ({r.get('slot_write_gbps_min', 0):.1f} min), host->device transfer "
            f"{r.get('h2d_copy_gbps_p50', 0):.1f} GB/s p50"
            for r in stages
        )]  # fmt: skip
    for r in rows:
        for gap in r.get("largest_gaps", [])[:2]:
            if not r["window"].startswith("requests"):
                break
            steps = ", ".join(
                f"[{e['t_end']:.3f} {e['seconds'] * 1e3:.1f}ms r{e['rows']} t{e['tokens']}"
                f"{' d' if e['decode'] else ''}{' p' if e['pipelined'] else ''}"
                f" h{e['host_s'] * 1e3:.1f} g{e['gpu_ms'] or 0:.1f} w{e['slot_writes']}]"
                for e in gap["steps"]
            )
            lines.append(f"gap {gap['gap_ms']:.1f} ms in {r['window']}: {steps}")
    for r in rows:
        if not r["window"].startswith(("register", "requests")) or not r.get("slowest_steps"):
            continue
        lines.append(f"slowest steps in {r['window']}: " + "; ".join(
            f"{e['seconds'] * 1e3:.1f} ms (rows {e['rows']}, tokens {e['tokens']}, "
            f"host {e['host_s'] * 1e3:.1f} ms, writes {e['slot_writes']})"
            for e in r["slowest_steps"][:4]
        ))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few seconds")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--resident", type=int, default=4)
    ap.add_argument("--storms", type=int, nargs="+", default=[24, 64])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-cpu-loras", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--loader-processes", type=int, default=None)
    ap.add_argument("--max-concurrent-loads", type=int, default=8)
    ap.add_argument("--kv-cache-gb", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--storm-prompt-len", type=int, default=16)
    ap.add_argument("--storm-tokens", type=int, default=8)
    ap.add_argument("--quiet-s", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=1.5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--commit", default=None, help="the commit to report (default: git HEAD)")
    ap.add_argument("--plot", default=None, help="write the step timeline as a PNG here")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in dict(
            streams=4,
            resident=2,
            storms=[3],
            rank=8,
            max_loras=4,
            max_cpu_loras=6,
            prompt_len=16,
            max_tokens=400,
            quiet_s=0.5,
            settle_s=0.3,
        ).items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)  # fmt: skip
    result = asyncio.run(run(args))
    print(table(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if args.plot:
        plot_timeline(result, args.plot)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
