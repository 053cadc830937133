"""Which (rows per program, chunk width, warps) makes the fused add+RMSNorm fastest at decode
sizes; each config is also checked against the torch twin.

    python -m benchmarks.norm_configs
"""

from __future__ import annotations

import functools

import torch
from triton.testing import do_bench_cudagraph

from loraplex.engine.lora.mapping import LoRAMapping
from loraplex.engine.model.kernels.add_rmsnorm import NormConfig, lora_add_rmsnorm_triton
from loraplex.engine.model.kernels.reference import lora_add_rmsnorm_torch

CONFIGS = [
    NormConfig(block_t=1, block_h=256, num_warps=8),
    NormConfig(block_t=1, block_h=1024, num_warps=8),
    NormConfig(block_t=1, block_h=2048, num_warps=8),
    NormConfig(block_t=1, block_h=4096, num_warps=16),
    NormConfig(block_t=2, block_h=1024, num_warps=8),
]


def main() -> None:
    h, r = 4096, 16
    for loras in (0, 8):
        for t in (1, 64, 128):
            dev = "cuda"
            g = torch.Generator(device=dev).manual_seed(t)
            n = h + loras * r
            y = torch.randn(t, n, device=dev, generator=g).to(torch.bfloat16)
            res0 = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
            w = (1 + 0.1 * torch.randn(h, device=dev, generator=g)).to(torch.bfloat16)
            b = (0.01 * torch.randn(max(loras, 1), h, r, device=dev, generator=g)).to(
                torch.bfloat16
            )
            slots = LoRAMapping(torch.arange(t, device=dev, dtype=torch.int32) % max(loras, 1))
            lb = b if loras else None
            ref_res, ref_out = res0.clone(), torch.empty_like(res0)
            lora_add_rmsnorm_torch(y, ref_res, lb, slots, w, 1e-5, ref_out)
            cells = []
            for cfg in CONFIGS:
                res, out = res0.clone(), torch.empty_like(res0)
                try:
                    lora_add_rmsnorm_triton(y, res, lb, slots, w, 1e-5, out, config=cfg)
                    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                    fn = functools.partial(
                        lora_add_rmsnorm_triton, y, res, lb, slots, w, 1e-5, out, config=cfg
                    )
                    us = do_bench_cudagraph(fn, rep=30) * 1e3
                    cells.append(f"{us:.1f}us/{err:.0e}")
                except Exception as e:  # noqa: BLE001
                    cells.append(f"fail:{type(e).__name__}")
            print(f"loras {loras} T {t}: " + " | ".join(cells), flush=True)
    print("configs:", [(c.block_t, c.block_h, c.num_warps) for c in CONFIGS])


if __name__ == "__main__":
    main()
