"""The base path's big launches at decode sizes (Llama-3-8B shapes, bf16): the four projection
GEMMs under each BLAS backend torch offers, and paged decode attention per split-K factor
and key tile. Each timed alone in a CUDA graph (L2 not warm across replays of large weights);
floor = bytes moved at the copy bandwidth of the same run.

    python -m benchmarks.base_configs [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from loraplex.engine.model.paged_attention import paged_decode_attention

H, INTER, HQ, HKV, D = 4096, 14336, 32, 8, 128
GEMMS = {  # name: (N, K) of the augmented weight with 8 slots of rank 16
    "qkv": (6144 + 3 * 128, H),
    "o": (H + 128, H),
    "gate_up": (2 * INTER + 2 * 128, H),
    "down": (H + 128, INTER),
}


def copy_bw() -> float:
    """Device copy bandwidth, timed like benchmarks/decode.py (event-timed back-to-back 1 GiB
    copies; a graph benchmark's cache flush between replays would halve it)."""
    from benchmarks.decode import copy_bandwidth

    return copy_bandwidth()


def gemms(bw: float, batches: list[int]) -> list[str]:
    lines = ["| gemm | T | backend | µs | floor µs | floor/time |", "|---|---:|---|---:|---:|---:|"]
    for (name, (n, k)), t in itertools.product(GEMMS.items(), batches):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
        floor = (w.numel() * 2 + x.numel() * 2 + t * n * 2) / bw * 1e6
        for backend in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(backend)
            try:
                us = do_bench_cudagraph(lambda w=w, x=x: F.linear(x, w), rep=50) * 1e3
                lines.append(
                    f"| {name} | {t} | {backend} | {us:.1f} | {floor:.1f} | {floor / us:.2f} |"
                )
            except Exception as e:  # noqa: BLE001
                lines.append(f"| {name} | {t} | {backend} | {type(e).__name__} | | |")
            print(lines[-1], flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
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
                us = do_bench_cudagraph(fn, rep=50) * 1e3
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
    args = ap.parse_args()
    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    lines = [
        f"copy bandwidth {bw / 1e12:.2f} TB/s\n",
        *gemms(bw, args.batches),
        "",
        *attention(bw, args.batches, args.ctx),
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
