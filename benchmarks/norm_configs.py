"""Which (rows per program, chunk width, warps, split rows) makes the fused add+RMSNorm fastest
at decode sizes, per LoRA rank; each config is also checked against the torch twin. B is laid
out as the engine's slots (rank-major, model/lora/layers.py); split configs are add_rmsnorm_split.py.

    python -m benchmarks.norm_configs [--ranks 16 64] [--batches 1 32 64 128] [--cold-l2]
"""

from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.graph_timing import graph_us
from loraplex.engine.model.kernels.add_rmsnorm import (
    NormConfig,
    lora_add_rmsnorm_triton,
    norm_config,
)
from loraplex.engine.model.kernels.reference import lora_add_rmsnorm_torch
from loraplex.engine.model.lora.mapping import LoRAMapping

CONFIGS = [
    NormConfig(block_t=1, block_h=256, num_warps=8),
    NormConfig(block_t=1, block_h=1024, num_warps=8),
    NormConfig(block_t=1, block_h=2048, num_warps=8),
    NormConfig(block_t=1, block_h=4096, num_warps=16),
    NormConfig(block_t=2, block_h=1024, num_warps=8),
    NormConfig(block_t=1, block_h=256, num_warps=4, split=True),
    NormConfig(block_t=1, block_h=512, num_warps=4, split=True),
    NormConfig(block_t=1, block_h=512, num_warps=8, split=True),
    NormConfig(block_t=1, block_h=1024, num_warps=8, split=True),
    NormConfig(block_t=2, block_h=1024, num_warps=8, split=True),
    NormConfig(block_t=4, block_h=1024, num_warps=8, split=True),
    NormConfig(block_t=4, block_h=512, num_warps=4, split=True),
    NormConfig(block_t=4, block_h=256, num_warps=4, split=True),
    NormConfig(block_t=8, block_h=512, num_warps=8, split=True),
    NormConfig(block_t=16, block_h=256, num_warps=4, split=True),
    NormConfig(block_t=16, block_h=128, num_warps=4, split=True),
]


def label(c: NormConfig) -> str:
    return f"({c.block_t}, {c.block_h}, {c.num_warps}, {c.split})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128])
    ap.add_argument("--cold-l2", action="store_true", help="B from HBM, as in a step")
    ap.add_argument(
        "--b-layout", choices=["rank-major", "column-major"], default="rank-major",
        help="B of a slot stored (R, H) as the engine's slots (default) or (H, R): a program's "
        "column chunk then one contiguous run",
    )  # fmt: skip
    args = ap.parse_args()
    configs = CONFIGS
    h = 4096
    for r in args.ranks:
        for loras in (0, 8):
            for t in args.batches:
                dev = "cuda"
                g = torch.Generator(device=dev).manual_seed(t)
                y = torch.randn(t, h + loras * r, device=dev, generator=g).to(torch.bfloat16)
                res0 = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
                w = (1 + 0.1 * torch.randn(h, device=dev, generator=g)).to(torch.bfloat16)
                b = 0.01 * torch.randn(max(loras, 1), r, h, device=dev, generator=g)
                b = b.to(torch.bfloat16).permute(0, 2, 1)  # (L, H, R) stored (L, R, H)
                if args.b_layout == "column-major":
                    b = b.contiguous()  # (L, H, R) stored so
                ts = torch.arange(t, device=dev, dtype=torch.int32) * max(loras, 1) // t
                slots = LoRAMapping(ts)  # rows grouped by slot, as the engine sends them
                lb = b if loras else None
                ref_res, ref_out = res0.clone(), torch.empty_like(res0)
                lora_add_rmsnorm_torch(y, ref_res, lb, slots, w, 1e-5, ref_out)
                cells = []
                for cfg in configs:
                    res, out = res0.clone(), torch.empty_like(res0)
                    try:
                        lora_add_rmsnorm_triton(y, res, lb, slots, w, 1e-5, out, config=cfg)
                        e = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                        fn = functools.partial(
                            lora_add_rmsnorm_triton, y, res, lb, slots, w, 1e-5, out, config=cfg
                        )
                        us = graph_us(fn, cold_l2=args.cold_l2)
                        cells.append(f"{us:.1f}us/{e:.0e}")
                    except Exception as ex:  # noqa: BLE001
                        cells.append(f"fail:{type(ex).__name__}")
                d = norm_config(t, h, r if loras else 0, dev)
                print(f"rank {r} loras {loras} T {t} (default {label(d)}): " + " | ".join(cells),
                      flush=True)  # fmt: skip
    print("configs:", [label(c) for c in configs])


if __name__ == "__main__":
    main()
