"""Benchmark paged decode attention at Llama-3-8B shapes (Hq 32, Hkv 8, D 128, bf16, block 16).

    python benchmarks/attention.py                      # on a GPU, ~1 minute
    python benchmarks/attention.py --append results.md  # also append the table to a file
    python benchmarks/attention.py --smoke              # tiny shapes; CPU via the interpreter

Every sequence of a case has the same context length; its blocks are scattered over the cache.
Timed with ``triton.testing.do_bench`` (median, L2 flushed): our kernel as a CUDA-graph replay
and eagerly; torch gathering K/V through the block table + SDPA; and, as a lower bound, SDPA
(flash backend) on contiguous K/V. GQA is folded for torch (the G query heads of a KV head are G
queries), so no baseline reads K/V more than once. GB/s = K+V bytes of the contexts / time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from loraplex.engine.model import paged_attention as pa  # noqa: E402


@dataclass
class Row:
    batch: int
    ctx: int
    parts: int
    graph_us: float
    eager_us: float
    gather_us: float
    flash_us: float
    kv_bytes: int
    rel_err: float


def time_us(fn: Callable[[], object], cuda: bool) -> float:
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


def flash_only(cuda: bool) -> contextlib.AbstractContextManager[None]:
    if not cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def run_case(
    batch: int, ctx: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> Row:
    cuda = device.type == "cuda"
    hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    groups, scale = hq // hkv, d**-0.5
    g = torch.Generator(device=device).manual_seed(batch * 7919 + ctx)
    nblk = -(-ctx // bs)
    num_blocks = batch * nblk + 1
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=device, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, device=device, generator=g).to(dtype)
    perm = torch.randperm(num_blocks - 1, device=device, generator=g) + 1
    tables = perm.view(batch, nblk).to(torch.int32)
    ctx_t = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, generator=g).to(dtype)
    out = torch.empty_like(q)
    parts, block_n = args.partitions, args.block_n
    if parts is None:  # the kernel's defaults (_launch)
        sms = pa.device_sms(device)
        if block_n is None:
            fp32 = dtype == torch.float32
            block_n, parts = pa.decode_tiles(batch, hkv, nblk * bs, sms, d, fp32, device)
        else:
            parts = pa.decode_partitions(batch, hkv, nblk * bs, block_n, sms)

    def ours() -> None:
        pa.paged_decode_attention(
            q, k_cache, v_cache, tables, ctx_t, scale, out=out, num_partitions=parts,
            block_n=block_n,
        )  # fmt: skip

    def gathered() -> tuple[torch.Tensor, torch.Tensor]:
        k = k_cache[tables].view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)  # (B, Hkv, ctx, D)
        v = v_cache[tables].view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)
        return k, v

    def gather_sdpa() -> torch.Tensor:
        k, v = gathered()
        return F.scaled_dot_product_attention(q.view(batch, hkv, groups, d), k, v, scale=scale)

    k_c, v_c = (t.contiguous() for t in gathered())
    q4 = q.view(batch, hkv, groups, d)

    def flash() -> torch.Tensor:
        with flash_only(cuda):
            return F.scaled_dot_product_attention(q4, k_c, v_c, scale=scale)

    ours()  # compiles
    ref = F.scaled_dot_product_attention(q4.float(), k_c.float(), v_c.float(), scale=scale)
    ref = ref.reshape(batch, hq, d)
    rel_err = float((out.float() - ref).norm() / ref.norm())

    eager_us = time_us(ours, cuda)
    graph_us = float("nan")
    if cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ours()
        graph_us = time_us(graph.replay, cuda)
    gather_us = time_us(gather_sdpa, cuda)
    try:
        flash_us = time_us(flash, cuda)
    except RuntimeError:  # no flash kernel for these inputs
        flash_us = float("nan")
    kv_bytes = 2 * batch * ctx * hkv * d * k_cache.element_size()
    return Row(batch, ctx, parts, graph_us, eager_us, gather_us, flash_us, kv_bytes, rel_err)


def render(rows: list[Row]) -> str:
    lines = [
        "| batch | ctx | parts | graph µs | eager µs | GB/s | gather+SDPA µs | flash SDPA µs "
        "| flash GB/s | ours/flash | rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in rows:
        t = w.graph_us if w.graph_us == w.graph_us else w.eager_us  # nan-safe: prefer graph
        lines.append(
            f"| {w.batch} | {w.ctx} | {w.parts} | {w.graph_us:.1f} | {w.eager_us:.1f} "
            f"| {w.kv_bytes / (t * 1e-6) / 1e9:.0f} | {w.gather_us:.1f} | {w.flash_us:.1f} "
            f"| {w.kv_bytes / (w.flash_us * 1e-6) / 1e9:.0f} | {t / w.flash_us:.2f} "
            f"| {w.rel_err:.1e} |"
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
    p.add_argument("--append", metavar="PATH", help="append the table to this markdown file")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    p.add_argument("--ctx", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--partitions", type=int, help="split-K override (default: heuristic)")
    p.add_argument("--block-n", type=int, help="key tile override (default: 64)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        p.error("no CUDA device: use --smoke for a CPU check")
    if args.smoke:
        args.batches, args.ctx = [1, 4], [16, 40]
        args.heads, args.kv_heads, args.head_dim, args.block_size = 4, 2, 32, 4
    device = torch.device("cuda" if cuda else "cpu")
    # The interpreter's bfloat16 tl.dot is broken: float16 on CPU.
    dtype = torch.bfloat16 if cuda else torch.float16

    rows: list[Row] = []
    for ctx in args.ctx:
        for batch in args.batches:
            row = run_case(batch, ctx, args, device, dtype)
            print(
                f"batch {batch:4d} ctx {ctx:5d} parts {row.parts:2d}: {row.graph_us:8.1f} µs graph, "
                f"{row.eager_us:8.1f} µs eager, {row.gather_us:8.1f} µs gather+SDPA, "
                f"{row.flash_us:8.1f} µs flash, rel err {row.rel_err:.1e}",
                flush=True,
            )
            rows.append(row)
            if cuda:
                torch.cuda.empty_cache()

    name = torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)"
    table = render(rows)
    print()
    print(table)
    if args.append:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        head = (
            f"## Paged decode attention: {stamp}, commit {git_commit()}, {name}, {dtype}, "
            f"Hq {args.heads} Hkv {args.kv_heads} D {args.head_dim} block {args.block_size}"
        )
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(f"\n{head}\n\n{table}\n")
    bad = [w for w in rows if not w.rel_err < 2e-2]
    if bad:
        sys.exit(f"rel err too high in {len(bad)} case(s)")


if __name__ == "__main__":
    main()
