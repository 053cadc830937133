"""What the DoRA row scale costs inside the fused epilogues, kernel by kernel (issue 19).

The decode graphs hold the epilogues without DoRA (a graph variant with it cost every step
3-6 % on the H200, BENCHMARKS.md). This times each epilogue of one Llama-3-8B layer (bf16,
rank 16, rows grouped by slot, the engine's launch configs) three ways, each alone in a CUDA
graph and checked against its torch twin:

- ``plain``: no DoRA tables (what the graphs run now);
- ``variant``: the DoRA tables passed, no slot flagged (what a graph with the variant would
  run in a step without DoRA rows: the price every user would pay);
- ``1 slot``: one slot of the step flagged (a step with DoRA rows).

    python -m benchmarks.dora_epilogues [--batches 32 64] [--loras 8 32] [--append FILE]
    python -m benchmarks.dora_epilogues --smoke      # tiny shapes, no timing (CPU: interpreter)

The last column scales the per-layer difference to a step (32 layers).
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton

from loraplex.engine.model import kernels as K  # noqa: E402
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping  # noqa: E402

SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim, layers
    "llama3-8b": (4096, 14336, 32, 8, 128, 32),
    "smoke": (64, 96, 4, 2, 16, 2),
}
VARIANTS = ("plain", "variant", "1 slot")


def _tables(loras: int, n: int, flagged: int | None, dev: str, dtype: torch.dtype) -> DoraRows:
    g = torch.Generator(device=dev).manual_seed(n + loras)
    scale = 0.9 + 0.2 * torch.rand(loras + 1, n, device=dev, generator=g)
    scale[loras] = 1.0
    on = torch.zeros(loras + 1, dtype=torch.int32, device=dev)
    if flagged is not None:
        on[flagged] = 1
    return DoraRows(scale.to(dtype), on, None)


def _cases(t: int, loras: int, rank: int, shape: tuple, dev: str, dtype: torch.dtype):
    """(op, fn(impl, dora) -> outputs) per epilogue of one layer."""
    h, inter, hq, hkv, d, _ = shape
    g = torch.Generator(device=dev).manual_seed(t * 31 + loras)
    slots = (torch.arange(t, device=dev) * loras // t).to(torch.int32)
    mapping = LoRAMapping(slots, triton=True)
    twin_map = LoRAMapping(slots)

    def y_b(n: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randn(t, n + s * loras * rank, device=dev, generator=g).to(dtype)
        b = 0.05 * torch.randn(loras, rank, n, device=dev, generator=g)
        return y, b.to(dtype).permute(0, 2, 1)

    y_o, b_o = y_b(h, 1)
    y_gu, b_gu = y_b(2 * inter, 2)
    n_qkv = (hq + 2 * hkv) * d
    y_qkv, b_qkv = y_b(n_qkv, 3)
    res0 = torch.randn(t, h, device=dev, generator=g).to(dtype)
    w = torch.randn(h, device=dev, generator=g).to(dtype)
    pos = torch.arange(t, device=dev) + 100
    ang = torch.arange(512, device=dev)[:, None] * torch.rand(1, d, device=dev, generator=g)
    cos, sin = ang.cos(), ang.sin()
    smap = torch.arange(t, device=dev) * 16 + 3

    def norm(triton: bool, dora: DoraRows | None) -> tuple[torch.Tensor, ...]:
        res, out = res0.clone(), torch.empty_like(res0)
        fn = K.lora_add_rmsnorm if triton else K.lora_add_rmsnorm_torch
        m = mapping if triton else twin_map
        return _run(lambda: fn(y_o, res, b_o, m, w, 1e-5, out, dora), triton, res, out)

    def silu(triton: bool, dora: DoraRows | None) -> tuple[torch.Tensor, ...]:
        out = torch.empty(t, inter, device=dev, dtype=dtype)
        fn = K.lora_silu_mul if triton else K.lora_silu_mul_torch
        m = mapping if triton else twin_map
        return _run(lambda: fn(y_gu, b_gu, m, out, dora), triton, out)

    def qkv(triton: bool, dora: DoraRows | None) -> tuple[torch.Tensor, ...]:
        kc = torch.zeros(t, 16, hkv, d, device=dev, dtype=dtype)
        vc, q = torch.zeros_like(kc), torch.empty(t, hq, d, device=dev, dtype=dtype)
        fn = K.lora_qkv_rope if triton else K.lora_qkv_rope_torch
        m = mapping if triton else twin_map
        return _run(
            lambda: fn(y_qkv, b_qkv, m, pos, cos, sin, kc, vc, smap, q, dora), triton, q, kc, vc
        )

    return [("qkv_rope", qkv, n_qkv), ("add_rmsnorm", norm, h), ("silu_mul", silu, 2 * inter)]


_TIMED: list[float] = []


def _run(call: Callable[[], None], triton: bool, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run ``call`` once (its outputs: the check); Triton on CUDA: then time it in a graph."""
    call()
    got = tuple(o.clone() for o in outs)  # before timing: add_rmsnorm updates its residual
    if triton and torch.cuda.is_available():
        from triton.testing import do_bench_cudagraph

        _TIMED.append(do_bench_cudagraph(call, rep=30) * 1e3)
    return got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-9)).item()


def measure(t: int, loras: int, rank: int, shape: tuple, dtype: torch.dtype) -> list[dict]:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for op, fn, n in _cases(t, loras, rank, shape, dev, dtype):
        row: dict = {"op": op, "T": t, "loras": loras}
        for variant in VARIANTS:
            flagged = None if variant != "1 slot" else loras // 2
            dora = None if variant == "plain" else _tables(loras, n, flagged, dev, dtype)
            _TIMED.clear()
            got = fn(True, dora)
            want = fn(False, dora)
            row[f"{variant} err"] = max(_rel(a, b) for a, b in zip(got, want, strict=True))
            row[variant] = _TIMED[0] if _TIMED else float("nan")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--loras", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32, no timing")
    ap.add_argument("--append", default=None, help="append the table to this file")
    args = ap.parse_args(argv)
    shape = SHAPES["smoke" if args.smoke else "llama3-8b"]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    batches, loras = ([8], [2]) if args.smoke else (args.batches, args.loras)
    layers = shape[5]
    lines = [
        "| op | loras | T | plain µs | variant µs | 1 slot µs | variant - plain, per step µs "
        "| max rel err vs twin |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lo, t in itertools.product(loras, batches):
        for r in measure(t, lo, args.rank, shape, dtype):
            mult = 2 if r["op"] == "add_rmsnorm" else 1  # o_proj and down_proj
            step = (r["variant"] - r["plain"]) * mult * layers
            errs = max(r[f"{v} err"] for v in VARIANTS)
            line = (
                f"| {r['op']} | {lo} | {t} | {r['plain']:.2f} | {r['variant']:.2f} "
                f"| {r['1 slot']:.2f} | {step:+.0f} | {errs:.1e} |"
            )
            print(line, flush=True)
            lines.append(line)
            if errs > (1e-5 if dtype == torch.float32 else 2e-2):
                raise SystemExit(f"{r['op']}: off its twin ({errs:.1e})")
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
