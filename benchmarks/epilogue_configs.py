"""Launch configs of the qkv_rope and silu_mul LoRA epilogues at decode sizes (Llama-3-8B
shapes, bf16, rank 16 or ``--rank``, B rank-major as in the engine's slots, rows grouped by slot
as the engine sends them). Each config is timed alone in a CUDA graph and checked against the
torch twin; the fastest per case is marked.

    python -m benchmarks.epilogue_configs [--out FILE] [--rank 64 --batches 32 64 --loras 8]
                                          [--cold-l2]   # inputs evicted from L2 before each launch
                                          [--ops silu_mul]

Columns: (block_t, block_n | -, warps, block_k); block_k > 0 is the packed delta (one dot per
block_k rank columns of every slot), 0 the per-slot loop.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.graph_timing import graph_us
from loraplex.engine.model.kernels.qkv_rope import (
    QKVRopeConfig,
    lora_qkv_rope_triton,
    qkv_rope_config,
)
from loraplex.engine.model.kernels.reference import lora_qkv_rope_torch, lora_silu_mul_torch
from loraplex.engine.model.kernels.silu_mul import (
    SiluMulConfig,
    lora_silu_mul_triton,
    silu_mul_config,
)
from loraplex.engine.model.lora.mapping import LoRAMapping

H, INTER, HQ, HKV, D = 4096, 14336, 32, 8, 128
R = 16  # --rank
COLD_L2 = False  # --cold-l2 (benchmarks/graph_timing.py)
B_COLUMN_MAJOR = False  # --b-layout column-major
SILU = [
    SiluMulConfig(bt, bn, w, bk)
    for bt, bn, w, bk in itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (0, 32, 64, 128))
] + [  # token blocks under 16: no tensor-core dot, one or two slots a program (rows grouped)
    SiluMulConfig(bt, bn, w, 0)
    for bt, bn, w in itertools.product((1, 2, 4, 8), (64, 128, 256, 512), (2, 4, 8))
]
QKV = [
    QKVRopeConfig(bt, w, bk) for bt, w, bk in itertools.product((16, 32, 64), (4, 8), (0, 32, 64))
] + [QKVRopeConfig(bt, w, 0) for bt, w in ((1, 2), (1, 4), (1, 8), (2, 4), (4, 4), (8, 4), (8, 8))]


def label(cfg: SiluMulConfig | QKVRopeConfig) -> str:
    """(block_t, block_n | -, warps, block_k)."""
    return f"({cfg.block_t}, {getattr(cfg, 'block_n', '-')}, {cfg.num_warps}, {cfg.block_k})"


def sorted_slots(t: int, loras: int, dev: str) -> LoRAMapping:
    """The step's LoRA metadata with rows grouped by slot."""
    slots = (torch.arange(t, device=dev, dtype=torch.int32) * loras // t).to(torch.int32)
    return LoRAMapping(slots)


def _b(loras: int, n: int, g: torch.Generator) -> torch.Tensor:
    """(L, n, R) bf16 stored (L, R, n), as the engine's slots (model/lora/layers.py)."""
    b = 0.05 * torch.randn(loras, R, n, device="cuda", generator=g)
    b = b.to(torch.bfloat16).permute(0, 2, 1)
    return b.contiguous() if B_COLUMN_MAJOR else b  # --b-layout column-major: (L, n, R) stored so


def err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-9)).item()


def silu_case(t: int, loras: int) -> list[tuple[str, float, float]]:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(t + loras)
    n = 2 * INTER
    y = torch.randn(t, n + 2 * loras * R, device=dev, generator=g).to(torch.bfloat16)
    b = _b(loras, n, g)
    slots = sorted_slots(t, loras, dev)
    ref = torch.empty(t, INTER, device=dev, dtype=torch.bfloat16)
    lora_silu_mul_torch(y, b, slots, ref)
    rows = []
    for cfg in SILU:
        out = torch.empty_like(ref)
        fn = functools.partial(lora_silu_mul_triton, y, b, slots, out, config=cfg)
        try:
            fn()
            us = graph_us(fn, cold_l2=COLD_L2)
            rows.append(
                (
                    label(cfg),
                    us,
                    err(out, ref),
                )
            )
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
            rows.append(
                (
                    f"{label(cfg)} {type(e).__name__}",
                    float("inf"),
                    0.0,
                )
            )
    return rows


def qkv_case(t: int, loras: int) -> list[tuple[str, float, float]]:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(7 * t + loras)
    q_size, kv_size = HQ * D, HKV * D
    n = q_size + 2 * kv_size
    y = torch.randn(t, n + 3 * loras * R, device=dev, generator=g).to(torch.bfloat16)
    b = _b(loras, n, g)
    slots = sorted_slots(t, loras, dev)
    pos = torch.arange(t, device=dev) + 500
    ang = torch.arange(1024, device=dev)[:, None] * torch.rand(1, D, device=dev, generator=g)
    cos, sin = ang.cos(), ang.sin()
    bs = 16
    smap = torch.arange(t, device=dev) * bs + 3

    def bufs():
        kc = torch.zeros(t, bs, HKV, D, device=dev, dtype=torch.bfloat16)
        return kc, torch.zeros_like(kc), torch.empty(t, HQ, D, device=dev, dtype=torch.bfloat16)

    kc0, vc0, q0 = bufs()
    args = (y, b, slots, pos, cos, sin)
    lora_qkv_rope_torch(*args, kc0, vc0, smap, q0)
    rows = []
    for cfg in QKV:
        kc, vc, q = bufs()
        fn = functools.partial(lora_qkv_rope_triton, *args, kc, vc, smap, q, config=cfg)
        try:
            fn()
            e = max(err(q, q0), err(kc, kc0), err(vc, vc0))
            us = graph_us(fn, cold_l2=COLD_L2)
            rows.append((label(cfg), us, e))
        except Exception as ex:  # noqa: BLE001
            rows.append(
                (
                    f"{label(cfg)} {type(ex).__name__}",
                    float("inf"),
                    0.0,
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--loras", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--cold-l2", action="store_true", help="B from HBM, as in a step")
    ap.add_argument("--ops", nargs="+", choices=["silu_mul", "qkv_rope"], default=None)
    ap.add_argument(
        "--b-layout", choices=["rank-major", "column-major"], default="rank-major",
        help="B of a slot stored (R, n) as the engine's slots (default) or (n, R): a program's "
        "column block then one contiguous run",
    )  # fmt: skip
    args = ap.parse_args()
    global R, COLD_L2, B_COLUMN_MAJOR
    R, COLD_L2 = args.rank, args.cold_l2
    B_COLUMN_MAJOR = args.b_layout == "column-major"
    lines = [
        "| op | loras | T | fastest (block_t, block_n, warps, block_k) | µs | engine default µs | rel err | top 3 |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for op, case in (("silu_mul", silu_case), ("qkv_rope", qkv_case)):
        if args.ops and op not in args.ops:
            continue
        for loras, t in itertools.product(args.loras, args.batches):
            rows = case(t, loras)
            bad = [r for r in rows if r[2] > 2e-2]
            ok = sorted((r for r in rows if r[2] <= 2e-2), key=lambda r: r[1])
            d = (silu_mul_config if op == "silu_mul" else qkv_rope_config)(t, loras, R, "cuda")
            key = label(d)
            default = next((r[1] for r in rows if r[0] == key), float("nan"))
            best = ok[0]
            top = "; ".join(f"{r[0]} {r[1]:.1f}" for r in ok[:3])
            line = f"| {op} | {loras} | {t} | {best[0]} | {best[1]:.1f} | {default:.1f} | {best[2]:.0e} | {top} |"
            if bad:
                line += f" ({len(bad)} configs off the twin: {bad[0][0]} {bad[0][2]:.1e})"
            print(line, flush=True)
            lines.append(line)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
