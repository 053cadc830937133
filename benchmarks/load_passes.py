"""One cold load's stages as multiples of the sha256 floor (issue 41, "one pass per byte").

A CPU load path without a model: the engine's own fetcher and stager (the calls
``AdapterLifecycle`` makes for ``add_adapter`` and a first request) over rank-16 bf16 adapters
of the Llama-3-8B shape (q/k/v/o: 27 MB; all seven modules: 84 MB), staged into float32, from a
local source, page cache warm, each load a fresh digest (a new file). Every stage's seconds are
printed as a multiple of ``hashlib.sha256`` over the same bytes (the two adapter files, in
memory), measured in the same run right before each load. The target: total <= 1.3 x.
``copied``: when the staging copy (written after the pass in this process's threads:
onepass.py's defer_copy) was sealed, from the same start; each load waits for it before the
next, so no load shares the cores with the one before.

    python -m benchmarks.load_passes                 # threads of this process (CPU default)
    python -m benchmarks.load_passes --helpers 1     # one loader process

Either way the image is packed into a region of a host pool, as in the engine (startup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.engine.adapters.fetch import AdapterFetcher
from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.version import AdapterVersion
from loraplex.engine.bench.synthetic import LLAMA3_8B
from loraplex.engine.config import EngineConfig
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.lora.slot_image import slot_image_numel

SIZES = {
    "27MB": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "84MB": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
_PARENT = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
STAGES = ("resolve", "fetch", "verify", "preflight", "stage")


def base_tensors(mc: ModelConfig, targets: tuple[str, ...], rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = mc.lora_module_shapes()
    out = {}
    for i in range(mc.num_layers):
        for m in targets:
            d_in, d_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.{_PARENT.get(m, 'self_attn')}.{m}"
            out[f"{key}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) * d_in**-0.5).to(
                torch.bfloat16
            )
            out[f"{key}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g) * 0.01).to(
                torch.bfloat16
            )
    return out


def write_adapter(folder: Path, tensors: dict, targets: tuple[str, ...], rank: int, n: int) -> None:
    """A fresh digest per load: one entry differs from every other file's."""
    folder.mkdir(parents=True)
    first = next(iter(tensors.values()))
    first[0, 0] = float(n + 1) * 1e-3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
           "target_modules": list(targets), "task_type": "CAUSAL_LM"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def sha256_floor(folder: Path, repeats: int = 3) -> tuple[float, int]:
    """Seconds of hashlib.sha256 over the two files' bytes (already in memory), best of N."""
    data = [(folder / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d in data:
            hashlib.sha256(d).hexdigest()
        best = min(best, time.perf_counter() - t0)
    return best, sum(len(d) for d in data)


async def one_load(
    fetcher: AdapterFetcher, folder: Path, n: int, dynamic: bool
) -> dict[str, float]:
    uri = folder.as_uri()
    await fetcher.allow_static(uri)
    v = AdapterVersion(name=folder.name, uri=uri, digest="", version=n)
    t0 = time.perf_counter()
    if dynamic:  # a first request for a name never fetched: the lifecycle's _fetched + stage
        try:
            staged = await fetcher.fetch_verify(v, trusted=True, stage=(torch.float32, False))
        except TypeError:  # (before the one pass: no stage along the fetch)
            staged = await fetcher.fetch_verify(v, trusted=True)
        t1 = time.perf_counter()
        if staged is None:  # (before the one pass: a separate stage step)
            await fetcher.stager.stage(v, torch.float32, pin=False)
    else:  # add_adapter's pass also packs the image; the first request stages only if not
        staged = await fetcher.fetch_verify(
            v, trusted=True, stage=(torch.float32, False), background=True
        )
        t1 = time.perf_counter()
        if staged is None:  # (no region free now)
            await fetcher.stager.stage(v, torch.float32, pin=False)
    t2 = time.perf_counter()
    if getattr(v, "copy", None) is not None:  # the staging copy, written after the pass
        v.seal, v.copy = await asyncio.wrap_future(v.copy), None
    t3 = time.perf_counter()
    fetcher.stager.release(v)
    fetcher.discard(v)
    out = {k: v.timings.get(k, 0.0) for k in STAGES}
    out.update(add=t1 - t0, first=t2 - t1, total=t2 - t0, copied=t3 - t0)
    return out


async def run(args: argparse.Namespace) -> None:
    # the torch threads of a CPU engine (startup.py: one core fewer than the machine has)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) - 1))
    mc = ModelConfig.from_dict(LLAMA3_8B)
    work = Path(tempfile.mkdtemp(prefix="load-passes-"))
    config = EngineConfig(device="cpu", dtype="float32", max_lora_rank=args.rank,
                          local_roots=(str(work),), loader_processes=args.helpers)  # fmt: skip
    # the engine's host pool (startup.host_pool: pre-faulted on the CPU), two regions here
    region = slot_image_numel(mc, args.rank) * 4
    pool = HostPool(region, 2, prefault=True)
    fetcher = AdapterFetcher(config, mc, pool=pool)
    if args.helpers:
        await asyncio.to_thread(fetcher.start_processes, args.helpers)
    rows = []
    try:
        for size in args.sizes:
            targets = SIZES[size]
            tensors = base_tensors(mc, targets, args.rank)
            ratios: dict[str, list[float]] = {}
            for n in range(args.repeats + 1):  # the first load warms imports: not counted
                folder = work / f"{size}-{n}"
                write_adapter(folder, tensors, targets, args.rank, n)
                floor, nbytes = sha256_floor(folder)
                t = await one_load(fetcher, folder, n, args.dynamic)
                if n == 0:
                    continue
                for k, s in t.items():
                    ratios.setdefault(k, []).append(s / floor)
                ratios.setdefault("floor_ms", []).append(floor * 1e3)
            row = {k: statistics.median(x) for k, x in ratios.items()}
            row["size"], row["mb"] = size, nbytes / 1e6
            rows.append(row)
    finally:
        await asyncio.to_thread(fetcher.close)
        shutil.rmtree(work, ignore_errors=True)  # (~1 GB of adapters at rank 16)
    mode = f"{args.helpers} loader process(es)" if args.helpers else "threads"
    mode += ", dynamic name" if args.dynamic else ", add_adapter then a request"
    print(f"mode: {mode}; medians of {args.repeats} loads; stage times / sha256 of the same bytes")
    cols = ("resolve", "fetch", "verify", "preflight", "stage", "add", "first", "total", "copied")
    print("| adapter | sha256 ms | " + " | ".join(cols) + " |")
    print("|---|---:|" + "---:|" * len(cols))
    for r in rows:
        vals = " | ".join(f"{r[c]:.2f}" for c in cols)
        print(f"| {r['size']} ({r['mb']:.1f} MB) | {r['floor_ms']:.1f} | {vals} |")


def adapter_args(doc: str) -> argparse.ArgumentParser:
    """The command line of a benchmark over these adapters (``--sizes``, ``--repeats``,
    ``--rank``), with the engine's logs quieted to warnings."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    return ap


def main() -> None:
    ap = adapter_args(__doc__)
    ap.add_argument("--helpers", type=int, default=0, help="loader processes (0: threads)")
    ap.add_argument(
        "--dynamic",
        action="store_true",
        help="a first request for a name never fetched (else add_adapter, request)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: cores - 1)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
