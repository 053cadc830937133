"""cuBLASLt / CUTLASS fp8 x fp8 GEMMs (``torch._scaled_mm``) at decode shapes, against bf16.

The question for the fp8 base at batch 16-64 (issue: LoRA on an fp8 base): does any
``_scaled_mm`` form stream the fp8 weight near the copy bandwidth at these skinny shapes,
so that a W8A8 path (activations quantized per token in the epilogue before each GEMM, the
per-channel weight scale applied after) could beat the weight-only Triton kernel? Forms, each
timed as the engine runs GEMMs (CUDA-graph replays, cycling through ``--copies`` weight copies
so projections smaller than L2 are read from memory):

- ``bf16``: ``F.linear`` on the bf16 weight (what the bf16 engine runs);
- ``tensor``: one scale per tensor (cuBLASLt's fp8 GEMM), bf16 out;
- ``rowwise``: a scale per token and per output channel (torch's CUTLASS row-wise kernel);
- ``tensor_f32``: per-tensor, float32 out (what a following epilogue could scale per row
  and column itself);
- ``block``: a scale per (token, 128 columns of K) and per (128 rows of N, 128 of K) (the
  DeepSeek-V3 recipe, where this torch build and GPU have it), in the two layouts of the
  activation scales (``block``: (T, K/128) row-major; ``block_t``: the same, column-major).
  Block scales are what the engine's epilogues could produce without a cross-program pass,
  where a program holds whole 128-column groups of its rows (attention's 128-wide heads; the
  RMSNorm / SiLU epilogues with column blocks of 128 or a multiple), where a per-token scale
  over a SiLU output row split across programs would need one.

Printed: microseconds, weight GB/s and the ratio to bf16 per (projection, tokens). The
activation quantization is not included in these (it would fold into the RMSNorm / SiLU
epilogues). The engine's whole projection, with the A rows of ``--slots`` slots of rank
``--rank`` (none for the LM head), in three more forms:

- ``bf16_aug``: ``F.linear`` on [W; A] (the bf16 engine's augmented GEMM);
- ``w8a16_aug``: ``fp8_aug_linear`` (kernels/fp8_linear.py: the weight-only Triton kernel, or
  the CUDA-core GEMV at 1-2 tokens; what the fp8 engine runs today);
- ``w8a8_aug``: ``fp8_w8a8_linear`` (kernels/fp8_w8a8.py: per-token quantization, the
  per-tensor ``_scaled_mm`` in float32, de-quantization, the A rows' GEMM: four launches),
  and each of its launches but the GEMM alone (``tensor_f32`` is the GEMM):
  ``w8a8_quant_part``, ``w8a8_dequant_part``, ``w8a8_arows_part`` (what folding each into a
  neighbouring kernel could save).

    python -m benchmarks.fp8_scaled_mm --out scaled_mm.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from benchmarks.fp8_gemm import SHAPES, copy_bandwidth, cycled
from benchmarks.record import git_commit
from loraplex.engine.model.kernels.fp8_linear import fp8_aug_linear
from loraplex.engine.model.kernels.fp8_w8a8 import dequant_cols, fp8_w8a8_linear, quant_rows

FP8 = torch.float8_e4m3fn


def shapes(name: str, vocab: int) -> list[tuple[str, int, int]]:
    h, inter, q, kv = SHAPES[name]
    return [
        ("qkv", q + 2 * kv, h),
        ("o", h, q),
        ("gate_up", 2 * inter, h),
        ("down", h, inter),
        ("lm_head", vocab, h),
    ]


SLICES = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1, "lm_head": 0}  # LoRA A row groups


def engine_forms(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, a: torch.Tensor) -> dict:
    """The engine's whole projection over one weight copy: [W; A] in bf16, and the fp8 base
    (weight ``wq`` with per-channel scale 1/16) weight-only and W8A8."""
    scale = torch.full((w.shape[0], 1), 1 / 16, device=x.device, dtype=torch.float32)
    rows = a if a.shape[0] else None
    w_aug = torch.cat([w, a])
    t, n = x.shape[0], w.shape[0]
    q, sx = quant_rows(x)
    one = torch.ones((), device=x.device, dtype=torch.float32)
    acc = torch._scaled_mm(q, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    y = torch.empty(t, n + a.shape[0], device=x.device, dtype=x.dtype)
    parts = {
        "bf16_aug": functools.partial(F.linear, x, w_aug),
        "w8a16_aug": functools.partial(fp8_aug_linear, x, wq, scale, rows),
        "w8a8_aug": functools.partial(fp8_w8a8_linear, x, wq, scale, rows),
        "w8a8_quant_part": functools.partial(quant_rows, x),
        "w8a8_dequant_part": functools.partial(dequant_cols, acc, sx, scale[:, 0], None, y[:, :n]),
    }
    if rows is not None:
        parts["w8a8_arows_part"] = functools.partial(torch.mm, x, a.t(), out=y[:, n:])
    return parts


def forms(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> dict:
    """name -> callable over one weight copy (w bf16 (N, K), wq fp8 (N, K))."""
    t, n = x.shape[0], w.shape[0]
    xq = x.to(FP8)
    one = torch.ones((), device=x.device, dtype=torch.float32)
    sa = torch.ones(t, 1, device=x.device, dtype=torch.float32)
    sb = torch.ones(1, n, device=x.device, dtype=torch.float32)
    wt = wq.t()  # column-major (K, N): what _scaled_mm wants as its second operand
    k = x.shape[1]
    sa_blk = torch.ones(t, -(-k // 128), device=x.device, dtype=torch.float32)
    sa_blk_t = sa_blk.t().contiguous().t()
    sb_blk = torch.ones(-(-n // 128), -(-k // 128), device=x.device, dtype=torch.float32)
    return {
        "bf16": functools.partial(F.linear, x, w),
        "tensor": functools.partial(torch._scaled_mm, xq, wt, one, one, out_dtype=torch.bfloat16),
        "rowwise": functools.partial(torch._scaled_mm, xq, wt, sa, sb, out_dtype=torch.bfloat16),
        "tensor_f32": functools.partial(
            torch._scaled_mm, xq, wt, one, one, out_dtype=torch.float32
        ),
        "block": functools.partial(
            torch._scaled_mm, xq, wt, sa_blk, sb_blk, out_dtype=torch.bfloat16
        ),
        "block_t": functools.partial(
            torch._scaled_mm, xq, wt, sa_blk_t, sb_blk, out_dtype=torch.bfloat16
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--slots", type=int, default=8, help="LoRA slots of the engine forms")
    ap.add_argument("--rank", type=int, default=16, help="their rank")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    print("| projection | T | N x K | form | µs | weight TB/s | / bf16 |")
    print("|---|---:|---|---|---:|---:|---:|")
    for name, n, k in shapes(args.shape, args.vocab):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        e = SLICES[name] * args.slots * args.rank
        copies = [
            (c, (c * 16).to(FP8), torch.randn(e, k, device="cuda", dtype=torch.bfloat16) / k)
            for c in [w] + [w.clone() for _ in range(args.copies - 1)]
        ]
        for t in args.batches:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            per_copy = [forms(x, c[0], c[1]) | engine_forms(x, *c) for c in copies]
            ref = F.linear(x, w).float()
            times = {}
            for form in per_copy[0]:
                try:
                    if form.endswith("_part"):  # one launch of W8A8: its time only
                        times[form] = cycled([p[form] for p in per_copy], args.reps) * 1e3
                        continue
                    got = per_copy[0][form]().float()
                    if form.endswith("_aug"):  # the engine's forms: the same projection
                        want = per_copy[0]["bf16_aug"]().float()
                        err = ((got - want).norm() / want.norm()).item()
                        # (fp8 weights, and in W8A8 fp8 activations: a few percent)
                        assert err < 0.08, f"{form} off by {err:.3f} (relative, Frobenius)"
                    elif form != "bf16":  # fp8 x fp8 of a 16x-scaled weight: shapes only
                        assert got.shape == ref.shape
                    times[form] = cycled([p[form] for p in per_copy], args.reps) * 1e3
                except Exception as ex:  # noqa: BLE001 - a form this build or GPU lacks
                    print(f"  skip {name} T={t} {form}: {type(ex).__name__}: {str(ex)[:100]}")
            for form, us in times.items():
                wbytes = n * k * (2 if form.startswith("bf16") else 1) + e * k * 2 * (
                    form.endswith("_aug")
                )
                wbytes *= not form.endswith("_part")  # (a part reads no weight)
                base = "bf16_aug" if form.endswith(("_aug", "_part")) else "bf16"
                row = dict(projection=name, T=t, N=n, K=k, form=form, us=us,
                           weight_tbps=wbytes / (us * 1e-6) / 1e12,
                           vs_bf16=us / times[base] if base in times else None)  # fmt: skip
                rows.append(row)
                print(f"| {name} | {t} | {n} x {k} | {form} | {us:.1f} | "
                      f"{row['weight_tbps']:.2f} | {row['vs_bf16'] or 0:.2f} |")  # fmt: skip
        del copies, w
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": git_commit(), "device": torch.cuda.get_device_name(),
                       "copy_bandwidth": bw, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
