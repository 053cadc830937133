"""The base path's big launches at decode sizes (Llama-3-8B shapes, bf16): the four projection
GEMMs under each BLAS backend torch offers, and paged decode attention per split-K factor
and key tile. Each timed alone in a CUDA graph (L2 not warm across replays of large weights);
floor = bytes moved at the copy bandwidth of the same run.

    python -m benchmarks.base_configs [--out FILE]
    python -m benchmarks.base_configs --batches 32 --rank 64 --cold-l2 --triton --only gemms

``--rank`` / ``--loras``: the A rows riding along in each augmented weight ([W; A], 8 slots of
rank 16 by default). ``--cold-l2``: each launch after a read that evicts the L2, as in a step
(benchmarks/graph_timing.py; the o projection's 38 MB would otherwise stay in the H200's L2
across replays). ``--triton``: also the split-K tensor-core GEMM of ``fp8_linear.py`` fed the
bf16 weight with unit scales (its fp8 conversion is then a no-op): a sweep of its tiles and
splits against cuBLAS at the same shapes, the question being whether a GEMM of our own reads
the skinny decode weights (qkv, o: 64-73 % of the copy bandwidth under cuBLAS) faster.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

from benchmarks.graph_timing import graph_us
from loraplex.engine.model.paged_attention import paged_decode_attention

H, INTER, HQ, HKV, D = 4096, 14336, 32, 8, 128
# name: (base rows N, K, LoRA slices): the augmented weight is N + slices x loras x rank rows
PROJECTIONS = {
    "qkv": (6144, H, 3),
    "o": (H, H, 1),
    "gate_up": (2 * INTER, H, 2),
    "down": (H, INTER, 1),
}
COLD_L2 = False  # --cold-l2


def time_us(fn) -> float:
    """µs per launch of ``fn`` in a CUDA graph, with the L2 warm or (``--cold-l2``) cold."""
    fn()
    return graph_us(fn, cold_l2=True) if COLD_L2 else do_bench_cudagraph(fn, rep=50) * 1e3


def triton_configs(t: int, k: int):
    """The split-K GEMM's tiles and splits swept at ``t`` tokens against K = ``k``."""
    from loraplex.engine.model.kernels.fp8_linear import Fp8LinearConfig

    bm = max(16, min(64, triton.next_power_of_2(t)))
    for bn, bk, split, warps in itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (4, 8)):
        if k % (split * bk) == 0 and k // split >= 2 * bk:
            yield Fp8LinearConfig(bm, bn, bk, split_k=split, num_warps=warps, num_stages=4)


def triton_gemm(name: str, t: int, n: int, k: int, e: int, bw: float) -> str:
    """The best of ``triton_configs`` for x (t, k) against a bf16 (n, k) weight and e A rows."""
    from loraplex.engine.model.kernels.fp8_linear import fp8_aug_linear

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    a = torch.randn(e, k, device="cuda", dtype=torch.bfloat16) * 0.02
    ones = torch.ones(n, 1, device="cuda", dtype=torch.float32)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), torch.cat([w, a]).float())
    out = torch.empty(t, n + e, device="cuda", dtype=torch.bfloat16)
    floor = ((n + e) * k * 2 + x.numel() * 2 + t * (n + e) * 2) / bw * 1e6
    best = None
    for cfg in triton_configs(t, k):
        fn = functools.partial(fp8_aug_linear, x, w, ones, a, config=cfg, out=out)
        try:
            us = time_us(fn)
        except Exception as ex:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"  {name} T {t} {cfg}: {type(ex).__name__}", flush=True)
            continue
        err = ((out.float() - want).norm() / want.norm()).item()
        if err < 1e-2 and (best is None or us < best[0]):
            best = (us, cfg)
    if best is None:
        return f"| {name} | {t} | triton split-K | no config ran | {floor:.1f} | |"
    us, c = best
    tag = f"triton split-K ({c.block_n}x{c.block_k}, split {c.split_k}, {c.num_warps} warps)"
    return f"| {name} | {t} | {tag} | {us:.1f} | {floor:.1f} | {floor / us:.2f} |"


def copy_bw() -> float:
    """Device copy bandwidth, timed like benchmarks/decode.py (event-timed back-to-back 1 GiB
    copies; a graph benchmark's cache flush between replays would halve it)."""
    from benchmarks.decode import copy_bandwidth

    return copy_bandwidth()


def gemms(bw: float, batches: list[int], rows: int, with_triton: bool) -> list[str]:
    """``rows``: A rows per LoRA slice (slots x rank)."""
    lines = ["| gemm | T | backend | µs | floor µs | floor/time |", "|---|---:|---|---:|---:|---:|"]
    for (name, (n0, k, slices)), t in itertools.product(PROJECTIONS.items(), batches):
        n = n0 + slices * rows
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        floor = (w.numel() * 2 + x.numel() * 2 + t * n * 2) / bw * 1e6
        for backend in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(backend)
            try:
                us = time_us(lambda w=w, x=x: F.linear(x, w))
                lines.append(
                    f"| {name} | {t} | {backend} | {us:.1f} | {floor:.1f} | {floor / us:.2f} |"
                )
            except Exception as e:  # noqa: BLE001
                lines.append(f"| {name} | {t} | {backend} | {type(e).__name__} | | |")
            print(lines[-1], flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
        if with_triton:
            lines.append(triton_gemm(name, t, n0, k, slices * rows, bw))
            print(lines[-1], flush=True)
    return lines


def attention(bw: float, batches: list[int], ctx: int) -> list[str]:
    lines = [
        "| attention | batch | ctx | parts | block_n | µs | GB/s | floor/time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bs, max_blocks = 16, 256
    for b in batches:
        nblk = -(-ctx // bs)
        kc = torch.randn(b * nblk + 1, bs, HKV, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        perm = torch.randperm(b * nblk, device="cuda").to(torch.int32)
        tables = torch.zeros(b, max_blocks, dtype=torch.int32, device="cuda")
        tables[:, :nblk] = perm.view(b, nblk)
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        kv_bytes = 2 * b * ctx * HKV * D * 2
        ref = paged_decode_attention(q, kc, vc, tables, lens, D**-0.5)
        for parts, block_n in itertools.product((None, 1, 2, 4), (32, 64, 128)):
            fn = functools.partial(
                paged_decode_attention, q, kc, vc, tables, lens, D**-0.5, out=out,
                num_partitions=parts, block_n=block_n,
            )  # fmt: skip
            try:
                fn()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                us = time_us(fn)
                gbs = kv_bytes / us / 1e3
                tag = "auto" if parts is None else parts
                lines.append(
                    f"| decode | {b} | {ctx} | {tag} | {block_n} | {us:.1f} | {gbs:.0f} | {kv_bytes / bw * 1e6 / us:.2f} |"
                    + (f" err {err:.1e}" if err > 1e-2 else "")
                )
            except Exception as e:  # noqa: BLE001
                lines.append(
                    f"| decode | {b} | {ctx} | {parts} | {block_n} | {type(e).__name__} | | |"
                )
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--ctx", type=int, default=536)
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of the A rows")
    ap.add_argument("--loras", type=int, default=8, help="slots of A rows")
    ap.add_argument("--cold-l2", action="store_true", help="weights from HBM, as in a step")
    ap.add_argument("--triton", action="store_true", help="also the split-K GEMM, bf16 weights")
    ap.add_argument("--only", choices=["gemms", "attention"], default=None)
    args = ap.parse_args()
    global COLD_L2
    COLD_L2 = args.cold_l2
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    lines = [f"copy bandwidth {bw / 1e12:.2f} TB/s" + (", cold L2" if COLD_L2 else "") + "\n"]
    if args.only != "attention":
        lines += gemms(bw, args.batches, args.rank * args.loras, args.triton) + [""]
    if args.only != "gemms":
        lines += attention(bw, args.batches, args.ctx)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
