"""fp8 base projections on the GPU: the W8A16 Triton augmented GEMM against bf16 and _scaled_mm.

For each projection of a model shape (Llama-3-8B by default) and each batch size, times as
the engine runs them (CUDA-graph replays of ``--reps`` calls):

- ``bf16``: ``F.linear`` on the bf16 augmented weight [W; A] (today's decode GEMM);
- ``fp8 triton``: ``fp8_aug_linear`` (kernels/fp8_linear.py) over a sweep of launch configs,
  the engine's own pick (``fp8_linear_config``) and the best of the sweep;
- ``scaled_mm``: ``torch._scaled_mm`` with row-wise scales on pre-quantized activations
  (the base columns only; the activation quantization is timed apart as ``quant``).

Bytes: weight bytes (fp8 base + bf16 A rows, or bf16 [W; A]) + activations in and out; the
floor is bytes over ``--bandwidth`` (the device's measured copy bandwidth). Checks every
kernel's output against the float32 twin first.

    python -m benchmarks.fp8_gemm --out results.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.record import git_commit
from loraplex.engine.model.gemm import _time_ms  # CUDA-graph replays of ``reps`` calls
from loraplex.engine.model.kernels.fp8_linear import (
    Fp8LinearConfig,
    fp8_aug_linear,
    fp8_aug_linear_torch,
    fp8_linear_config,
)
from loraplex.engine.model.quant import quantize_fp8

SHAPES = {  # name -> (hidden, intermediate, q_size, kv_size)
    "llama3-8b": (4096, 14336, 4096, 1024),
    "llama3-70b": (8192, 28672, 8192, 1024),
}


def projections(shape: str, slots: int, rank: int) -> list[tuple[str, int, int, int]]:
    """(name, N, K, E) per projection: E = slices * slots * rank A rows."""
    h, inter, q, kv = SHAPES[shape]
    return [
        ("qkv", q + 2 * kv, h, 3 * slots * rank),
        ("o", h, q, slots * rank),
        ("gate_up", 2 * inter, h, 2 * slots * rank),
        ("down", h, inter, slots * rank),
    ]


def sweep_configs(block_m: int) -> list[Fp8LinearConfig]:
    out = []
    for bn, bk, warps, stages in itertools.product(
        (16, 32, 64, 128), (128, 256, 512), (4, 8), (3, 4, 6)
    ):
        if (warps == 8) != (bn == 128):
            continue
        if stages * (block_m * bk * 2 + bk * bn * 3) > 200_000:
            continue  # over the shared memory of one SM
        out.append(Fp8LinearConfig(block_m, bn, bk, warps, stages))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4.2e12, help="bytes/s of the floor")
    ap.add_argument("--no-sweep", action="store_true", help="only the engine's own config")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    print(f"commit {git_commit()}  device {torch.cuda.get_device_name()}  shape {args.shape}")
    hdr = f"{'proj':8} {'T':>4} {'bf16 us':>8} {'fp8 us':>8} {'best us':>8} {'best cfg':28} "
    print(hdr + f"{'smm us':>7} {'quant us':>8} {'fp8 floor':>9} {'x floor':>7} {'x bf16':>6}")
    for name, n, k, e in projections(args.shape, args.slots, args.rank):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q, scale = quantize_fp8(w)
        q, scale = q.to(dev).contiguous(), scale.to(dev).float().reshape(n, -1).contiguous()
        a = torch.randn(e, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_aug = torch.cat([w, a])
        del w
        for t in args.batches:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_aug_linear_torch(x, q, scale, a).float()
            got = fp8_aug_linear(x, q, scale, a).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"{name} T={t}: relative error {err}"
            bf16_ms = _time_ms(functools.partial(F.linear, x, w_aug), args.reps)
            own = fp8_linear_config(t, n, k, k // scale.shape[1])
            fp8 = functools.partial(fp8_aug_linear, x, q, scale, a)
            own_ms = _time_ms(functools.partial(fp8, config=own), args.reps)
            best_ms, best = own_ms, own
            if not args.no_sweep:
                for cfg in sweep_configs(own.block_m):
                    try:
                        ms = _time_ms(functools.partial(fp8, config=cfg), args.reps)
                    except Exception as ex:  # noqa: BLE001 - out of shared memory etc.
                        print(f"  skip {cfg}: {type(ex).__name__}")
                        continue
                    if ms < best_ms:
                        best_ms, best = ms, cfg
            tp = max(t, 16)
            xp = torch.randn(tp, k, device=dev, dtype=torch.bfloat16)
            amax = xp.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
            sx = amax / 448.0
            xq = (xp / sx).to(torch.float8_e4m3fn)
            sw = scale.reshape(1, n) if scale.shape[1] == 1 else None
            smm_ms = quant_ms = None
            if sw is not None:
                try:
                    smm = functools.partial(
                        torch._scaled_mm, xq, q.t(), scale_a=sx, scale_b=sw,
                        out_dtype=torch.bfloat16,
                    )  # fmt: skip
                    smm_ms = _time_ms(smm, args.reps)
                except RuntimeError as ex:
                    print(f"  _scaled_mm: {ex}"[:200])

                def quant(xp=xp):
                    s = xp.abs().amax(dim=1, keepdim=True).float() / 448.0
                    return (xp / s).to(torch.float8_e4m3fn)

                quant_ms = _time_ms(quant, args.reps)
            fp8_bytes = n * k + e * k * 2 + t * k * 2 + t * (n + e) * 2 + n * 4
            floor_ms = fp8_bytes / args.bandwidth * 1e3
            row = {
                "proj": name, "T": t, "N": n, "K": k, "E": e, "bf16_ms": bf16_ms,
                "fp8_ms": own_ms, "fp8_cfg": own.__dict__, "best_ms": best_ms,
                "best_cfg": best.__dict__, "scaled_mm_ms": smm_ms, "quant_ms": quant_ms,
                "fp8_floor_ms": floor_ms, "rel_err": err,
            }  # fmt: skip
            rows.append(row)
            cfg_s = (
                f"{best.block_m}x{best.block_n}x{best.block_k} w{best.num_warps} s{best.num_stages}"
            )
            smm_s = f"{smm_ms * 1e3:7.1f}" if smm_ms else "      -"
            qs = f"{quant_ms * 1e3:8.1f}" if quant_ms else "       -"
            print(
                f"{name:8} {t:4} {bf16_ms * 1e3:8.1f} {own_ms * 1e3:8.1f} {best_ms * 1e3:8.1f} "
                f"{cfg_s:28} {smm_s} {qs} {floor_ms * 1e3:9.1f} {own_ms / floor_ms:7.2f} "
                f"{own_ms / bf16_ms:6.2f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": git_commit(), "shape": args.shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
