"""Benchmark the grouped LoRA kernels (shrink + expand) at Llama-3-8B decode shapes.

    python benchmarks/lora_kernels.py                      # on a GPU, ~1 minute
    python benchmarks/lora_kernels.py --append results.md  # also append the tables to a file
    python benchmarks/lora_kernels.py --smoke              # tiny shapes; CPU via the interpreter

Each case is checked against the torch reference first, then the shrink+expand pair is timed
as a CUDA-graph replay (and eagerly) with ``triton.testing.do_bench`` (median, L2 flushed). The
floor is the bytes the pair must move (x, the used adapters' A and B, y read and written, the
fp32 intermediate written and read) at the device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from loraplex.engine.model.lora import ops  # noqa: E402
from loraplex.engine.model.lora.mapping import LoRAMapping  # noqa: E402

# name -> (in_features, slice widths)
LLAMA3_8B = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
SMOKE = {
    "qkv": (64, (64, 16, 16)),
    "o": (64, (64,)),
    "gate_up": (64, (96, 96)),
    "down": (96, (64,)),
}


@dataclass
class Row:
    layer: str
    batch: int
    adapters: int
    graph_us: float
    eager_us: float
    bytes_moved: int
    floor_us: float
    rel_err: float
    cfg: str


def time_us(fn: Callable[[], None], cuda: bool) -> float:
    """Median microseconds of ``fn``: do_bench on CUDA, wall clock otherwise."""
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def copy_bandwidth(device: torch.device, cuda: bool) -> float:
    """Device copy bandwidth in bytes/s: (read + written) / time of a large copy."""
    n = (1 << 30) if cuda else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / (time_us(lambda: dst.copy_(src), cuda) * 1e-6)


def run_case(
    layer: str, in_features: int, widths: tuple[int, ...], batch: int, adapters: int,
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bandwidth: float,
) -> Row:  # fmt: skip
    from loraplex.engine.model.lora.ops.triton_expand import expand_config
    from loraplex.engine.model.lora.ops.triton_shrink import shrink_config

    cuda = device.type == "cuda"
    r, num_slots, s = args.rank, args.max_loras, len(widths)
    offsets = tuple(sum(widths[:i]) for i in range(s + 1))
    n = offsets[-1]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, in_features, device=device, generator=g).to(dtype)  # (T, in)
    a = torch.randn(s, num_slots, r, in_features, device=device, generator=g)
    a = (a * in_features**-0.5).to(dtype)  # (S, L, R, in)
    b = (torch.randn(num_slots, n, r, device=device, generator=g) * r**-0.5).to(dtype)  # (L, N, R)
    y0 = torch.randn(batch, n, device=device, generator=g).to(dtype)  # (T, N)
    slots = [t % adapters for t in range(batch)]  # round-robin over the adapters
    mapping = LoRAMapping.build(slots, [r] * num_slots, device=device)
    buf = torch.empty(s, batch, r, dtype=torch.float32, device=device)  # (S, T, R)

    scfg = shrink_config(mapping.max_seg_len, adapters, s, in_features, r, device)
    ecfg = expand_config(mapping.max_seg_len, adapters, s, max(widths), device)
    cfg = (
        f"s:{scfg.block_m}x{scfg.block_r}x{scfg.block_k}/k{scfg.split_k} "
        f"e:{ecfg.block_m}x{ecfg.block_n}x{ecfg.block_r}"
    )
    y = y0.clone()

    def pair() -> None:
        ops.shrink_triton(x, a, mapping, buf, config=scfg)
        ops.expand_triton(y, buf, b, offsets, mapping, config=ecfg)

    pair()  # compiles; y = y0 + delta
    y_ref = y0.clone()
    out_ref = torch.empty_like(buf)
    ops.shrink_torch(x, a, mapping, out_ref)
    ops.expand_torch(y_ref, out_ref, b, offsets, mapping)
    delta = (y_ref.float() - y0.float()).norm().clamp_min(1e-12)
    rel_err = float((y.float() - y_ref.float()).norm() / delta)

    eager_us = time_us(pair, cuda)
    graph_us = float("nan")
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair()
        graph_us = time_us(graph.replay, cuda)

    e = x.element_size()
    moved = (
        batch * in_features * e  # x read
        + adapters * s * r * in_features * e  # A of the used adapters
        + adapters * n * r * e  # B of the used adapters
        + 2 * batch * n * e  # y read + written
        + 2 * s * batch * r * 4  # fp32 intermediate written + read
    )
    return Row(
        layer, batch, adapters, graph_us, eager_us, moved, moved / bandwidth * 1e6, rel_err, cfg
    )


def render(rows: list[Row], bandwidth: float, num_layers: int) -> str:
    lines = [
        f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + written)",
        "",
        "| layer | batch | adapters | graph µs | eager µs | GB/s | floor µs | floor/time | rel err | config |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for w in rows:
        t = w.graph_us if w.graph_us == w.graph_us else w.eager_us  # nan-safe: prefer graph
        lines.append(
            f"| {w.layer} | {w.batch} | {w.adapters} | {w.graph_us:.1f} | {w.eager_us:.1f} "
            f"| {w.bytes_moved / (t * 1e-6) / 1e9:.0f} | {w.floor_us:.1f} | {w.floor_us / t:.0%} "
            f"| {w.rel_err:.1e} | {w.cfg} |"
        )
    lines += [
        "",
        f"Per decode step, all layers x{num_layers}:",
        "",
        "| batch | adapters | graph µs | eager µs | floor µs |",
        "|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(w.batch, w.adapters) for w in rows})
    for batch, adapters in keys:
        sel = [w for w in rows if (w.batch, w.adapters) == (batch, adapters)]
        lines.append(
            f"| {batch} | {adapters} | {num_layers * sum(w.graph_us for w in sel):.0f} "
            f"| {num_layers * sum(w.eager_us for w in sel):.0f} "
            f"| {num_layers * sum(w.floor_us for w in sel):.0f} |"
        )
    return "\n".join(lines)


def git_commit() -> str:
    try:
        res = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return res.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU too)")
    p.add_argument("--append", metavar="PATH", help="append the tables to this markdown file")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=32, help="adapter slots in the buffers")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--layers", nargs="+", default=list(LLAMA3_8B), choices=list(LLAMA3_8B))
    p.add_argument("--num-layers", type=int, default=32, help="decoder layers per step")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        p.error("no CUDA device: use --smoke for a CPU check")
    shapes = SMOKE if args.smoke else LLAMA3_8B
    if args.smoke:
        args.batches, args.adapters, args.max_loras = [1, 4], [1, 2], 4
    device = torch.device("cuda" if cuda else "cpu")
    # The interpreter's bfloat16 tl.dot is broken: float16 on CPU.
    dtype = torch.bfloat16 if cuda else torch.float16
    bandwidth = copy_bandwidth(device, cuda)

    rows: list[Row] = []
    for layer in args.layers:
        in_features, widths = shapes[layer]
        for batch in args.batches:
            counts = sorted({min(ad, batch, args.max_loras) for ad in args.adapters})
            for adapters in counts:
                row = run_case(
                    layer, in_features, widths, batch, adapters, args, device, dtype, bandwidth
                )
                print(
                    f"{layer:8s} batch {batch:4d} adapters {adapters:3d}: "
                    f"{row.graph_us:8.1f} µs graph, {row.eager_us:8.1f} µs eager, "
                    f"rel err {row.rel_err:.1e}",
                    flush=True,
                )
                rows.append(row)

    name = torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)"
    table = render(rows, bandwidth, args.num_layers)
    print()
    print(table)
    if args.append:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        head = f"## LoRA kernels: {stamp}, commit {git_commit()}, {name}, {dtype}, rank {args.rank}"
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(f"\n{head}\n\n{table}\n")
    bad = [w for w in rows if not w.rel_err < 2e-2]
    if bad:
        sys.exit(f"rel err too high in {len(bad)} case(s)")


if __name__ == "__main__":
    main()
