"""Decode cost against adapter rank and the engine's ``max_lora_rank`` (issue: mixed ranks).

    python -m benchmarks.mixed_rank                        # on a GPU, a few minutes
    python -m benchmarks.mixed_rank --append BENCHMARKS.md
    python -m benchmarks.mixed_rank --smoke                # tiny model on CPU: checks the script

Llama-3-8B shape, bf16, adapters on all seven linear modules, ctx 512, p50 of decode steps in
which every request decodes (the engine's step log), pipelined. Two figures, and the base model alone as their yardstick:

1. padding: batch 64 on 8 rank-8 adapters in an engine with ``max_lora_rank`` 64, against the
   same step in an engine with ``max_lora_rank`` 8 (goal: <= 1.05 x);
2. rank 64 itself: 32 streams on 8 adapters (8 slots) of rank 64 against rank 16, each step
   against its own bandwidth floor (base + adapters' A/B + KV read, at the copy bandwidth
   measured in the same run; goal: rank 64 within 1.2 x its floor);
3. the base model alone at 32 streams: how far the step is from its floor before any adapter
   (``--cases 3 4`` runs only rank 64 and this one).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.decode import base_bytes, copy_bandwidth, kv_bytes, pct, report, run_batch
from benchmarks.synthetic import LLAMA3_8B, random_model, write_adapter, write_model_config
from loraplex.engine import AsyncEngine, EngineConfig

# (name, adapter rank, engine max_lora_rank, batch)
CASES = [
    ("rank 8 in a rank-8 engine", 8, 8, 64),
    ("rank 8 in a rank-64 engine", 8, 64, 64),
    ("rank 16, 32 streams", 16, 16, 32),
    ("rank 64, 32 streams", 64, 64, 32),
    ("base only, 32 streams", 0, 16, 32),
]


async def case(args, bw, model_dir: Path, adapters: list[Path], rank: int, max_rank: int, batch):
    n = len(adapters)  # 0: the base model alone (what the adapters' share is measured against)
    model = random_model(args.cfg, max_loras=n, max_lora_rank=max_rank, device=args.device)
    wbytes = base_bytes(model)
    cfg = EngineConfig(
        model=str(model_dir), device=args.device, dtype="bfloat16", max_loras=n,
        max_cpu_loras=max(n, 1), max_lora_rank=max_rank, max_num_seqs=batch,
        max_num_batched_tokens=16384, kv_cache_bytes=args.kv_gb << 30, max_model_len=4096,
        enable_prefix_caching=False, cuda_graph_sizes=(batch,),  # the steps timed: one size
    )  # fmt: skip
    async with AsyncEngine(cfg, model=model) as engine:
        names: list[str | None] = [] if adapters else [None]
        for i, path in enumerate(adapters):
            await engine.add_adapter(f"a{i}", str(path))
            names.append(f"a{i}")
        await run_batch(engine, batch, names, args.ctx, 8, seed=1)  # warm-up: loads, graphs
        r = await run_batch(engine, batch, names, args.ctx, args.steps, seed=2)
    a_bytes = n * (adapters[0] / "adapter_model.safetensors").stat().st_size if n else 0
    floor = (wbytes + a_bytes + kv_bytes(args.cfg, batch, args.ctx + args.steps // 2)) / bw
    p50 = statistics.median(r["steps"])
    gpu = statistics.median(r["gpu"]) if r["gpu"] else float("nan")
    del model, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "rank": rank, "max_rank": max_rank, "batch": batch, "adapters": n,
        "p50_ms": p50 * 1e3, "p99_ms": pct(r["steps"], 0.99) * 1e3,
        "gpu_ms": gpu * 1e3, "floor_ms": floor * 1e3,
        "ratio": p50 / floor,
    }  # fmt: skip


def table(rows: list[dict], bw: float, commit: str | None) -> str:
    head = report([], bw, commit).splitlines()[1].replace("Engine decode", "Mixed ranks")
    lines = [
        "\n" + head + "\n",
        "| case | adapter rank | max_lora_rank | batch | adapters | p50 ms | p99 ms | GPU ms "
        "| floor ms | p50/floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['rank']} | {r['max_rank']} | {r['batch']} | {r['adapters']} | "
            f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['gpu_ms']:.2f} | {r['floor_ms']:.2f} | "
            f"{r['ratio']:.2f} |"
        )
    by = {r["case"]: r for r in rows}
    pad = by.get(CASES[1][0]), by.get(CASES[0][0])
    if all(pad):
        lines.append(
            f"\nrank 8 in a rank-64 engine / in a rank-8 engine: "
            f"{pad[0]['p50_ms'] / pad[1]['p50_ms']:.3f} x (goal <= 1.05)"
        )
    r64, r16 = by.get(CASES[3][0]), by.get(CASES[2][0])
    if r64 and r16:
        lines.append(
            f"rank 64 vs rank 16 at 32 streams: {r64['p50_ms'] / r16['p50_ms']:.2f} x; rank 64 "
            f"at {r64['ratio']:.2f} x its own floor (goal <= 1.2)"
        )
    base = by.get(CASES[4][0])
    if r64 and base:
        lines.append(
            f"base only at 32 streams: {base['p50_ms']:.2f} ms = {base['ratio']:.2f} x its floor; "
            f"rank-64 adapters add {r64['p50_ms'] - base['p50_ms']:.2f} ms (their bytes at the "
            f"copy bandwidth: {r64['floor_ms'] - base['floor_ms']:.2f} ms)"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-gb", type=int, default=24)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--append", default=None)
    ap.add_argument("--commit", default=None, help="commit to report (copies without git)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument(
        "--cases", type=int, nargs="+", default=None,
        help="indices into the case list (0-4; default all): " + "; ".join(
            f"{i}: {c[0]}" for i, c in enumerate(CASES)),
    )  # fmt: skip
    args = ap.parse_args()
    args.cfg, args.device, cases = LLAMA3_8B, "cuda", CASES
    if args.smoke:
        args.cfg = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        args.device, args.kv_gb, args.ctx, args.steps = "cpu", 1, 16, 16
        cases = [(name, rank, max_rank, 4) for name, rank, max_rank, _ in CASES]
    if args.cases is not None:
        cases = [cases[i] for i in args.cases]
    if args.workdir:
        run(args, cases, Path(args.workdir))
        return
    # a temporary dir of ~3 GB of rank-64 adapters: removed however the run ends (a device's
    # disk filled after a dozen runs in one call before)
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as work:
        run(args, cases, Path(work))


def run(args, cases, work: Path) -> None:
    model_dir = write_model_config(work / "model", args.cfg)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for name, rank, max_rank, batch in cases:
        t0 = time.perf_counter()
        adapters = [
            write_adapter(work / f"r{rank}-{i}", args.cfg, rank=rank, seed=i, device=args.device)
            for i in range(8 if rank else 0)
        ]
        row = asyncio.run(case(args, bw, model_dir, adapters, rank, max_rank, batch))
        row["case"] = name
        rows.append(row)
        print(f"{name}: {row} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = table(rows, bw, args.commit)
    print(out)
    if args.append:
        with open(args.append, "a") as f:
            f.write(out)


if __name__ == "__main__":
    main()
