"""W8A8: the augmented projection GEMM of an fp8 base on fp8 tensor cores (``fp8_w8a8_linear``).

The weight-only kernel (``fp8_linear.py``) converts fp8 weight tiles to bf16 in registers and
streams fp8 at ~2 TB/s at best; cuBLASLt's fp8 x fp8 GEMM (``torch._scaled_mm``, one scale
per operand) streams it at 2.2-4.0 TB/s at the decode shapes, 0.49-0.66 x the bf16 GEMM's time
at 1-128 tokens (``benchmarks/fp8_scaled_mm.py``). It needs the activations
in fp8 too, and only the per-tensor form is fast at these shapes (the row-wise form with a
scale per token and per channel is not), so the scales go around it:

1. ``quant_rows``: each token's row scaled by its own absmax (``s_x[t] = absmax / 448``) and
   rounded to e4m3 (one Triton launch, a program per row);
2. ``torch._scaled_mm(x_q, W_q^T)`` with unit scales and a float32 result: ``acc[t, n]``;
3. ``dequant_cols``: ``y[t, n] = (acc[t, n] * s_x[t]) * s_w[n] (+ bias[n])`` in float32,
   rounded once to the compute dtype (one Triton launch, no FMA contraction: its twin rounds
   the same way);
4. the LoRA A rows (compute dtype, E rows) by one GEMM of the unquantized x into the tail
   columns of the same (T, N + E) output, so the fused epilogues read it unchanged.

Weight scales per output channel only (``weight_scale`` (N, 1)); per-group scales keep the
weight-only kernel. cuBLASLt wants K and N multiples of 16. Semantics: ``fp8_w8a8_linear_torch``
(the twin: the same quantization, the GEMM in float32 over the de-quantized fp8 values).
Four launches instead of one: the quantization could later fold into the RMSNorm / SiLU
epilogues that produce x, the de-quantization into the epilogues that read y.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from loraplex.engine.model.backend import triton_reaches
from loraplex.engine.model.kernels.fp8_linear import aug_output, check_operands
from loraplex.engine.model.kernels.workspace import per_device

__all__ = [
    "FP8_MAX",
    "dequant_cols",
    "dequant_cols_torch",
    "fp8_w8a8_linear",
    "fp8_w8a8_linear_torch",
    "prepare_w8a8",
    "quant_rows",
    "quant_rows_torch",
    "w8a8_auto_min_tokens",
    "w8a8_device_ok",
    "w8a8_supported",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_EPS = 1e-12  # an all-zero row gets this absmax (its values quantize to 0)


def w8a8_supported(weight_fp8: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """The shapes and scales this path takes: per-channel scales, K and N multiples of 16."""
    n, k = weight_fp8.shape
    return (
        weight_fp8.dtype == FP8
        and weight_scale.dim() == 2
        and weight_scale.shape == (n, 1)
        and n % 16 == 0
        and k % 16 == 0
    )


# Where W8A8 beats the weight-only kernel, per projection (first slice name -> smallest token
# count), timed at Llama-3-8B shapes with eight rank-16 slots' A rows, 1-128 tokens
# (``benchmarks/fp8_scaled_mm.py``'s ``_aug`` forms). Weight-only wins the 1-token GEMV
# everywhere and o_proj up to 64 tokens (its four launches cost more than the 4096 x 4096
# weight's bytes save); gate_up's 28672 x 4096 weight pays for them from 16 tokens. Prefill
# sizes all run W8A8.
_AUTO_MIN_TOKENS = {"q_proj": 64, "o_proj": 128, "gate_proj": 16, "down_proj": 64}
_AUTO_OTHER = 64  # a projection the table does not name


def w8a8_auto_min_tokens(slice_names: tuple[str, ...]) -> int:
    """The measured W8A8 threshold of the projection holding ``slice_names`` (q/k/v, o,
    gate/up, down; 64 tokens for any other)."""
    return _AUTO_MIN_TOKENS.get(slice_names[0] if slice_names else "", _AUTO_OTHER)


def w8a8_device_ok(device: torch.device | str) -> bool:
    """Whether ``device`` runs the fp8 x fp8 GEMM: CUDA devices with fp8 tensor cores (compute
    capability 8.9+: Ada, Hopper and later); the CPU runs the twins (tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


# -- 1. per-token quantization ------------------------------------------------------------------


@triton.jit
def _round_e4m3(v):
    """``v`` (float32) rounded to nearest-even on the e4m3 grid, clamped to +-448: exact in
    float32 (a power-of-two step from the exponent, the 1.5 * 2^23 rounding trick), so that the
    conversion to fp8 that follows rounds nothing (the Triton interpreter's own conversion
    rounds ties and mantissa carries differently from the GPU's and torch's)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    step_e = tl.maximum(e, -6) - 3  # 3 mantissa bits; below 2^-6 the subnormal step 2^-9
    inv = ((127 - step_e) << 23).to(tl.float32, bitcast=True)
    step = ((127 + step_e) << 23).to(tl.float32, bitcast=True)
    y = v * inv  # |y| < 16: exact
    y = (y + 12582912.0) - 12582912.0  # round to the nearest integer, ties to even
    r = tl.abs(y * step)
    r = tl.where(bits < 0, -r, r)  # (the sign of zeros too)
    return tl.minimum(tl.maximum(r, -448.0), 448.0)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    tl.store(s_ptr + row, scale)
    q_row = q_ptr + row.to(tl.int64) * stride_q
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        q = _round_e4m3(tl.math.div_rn(x, scale))
        tl.store(q_row + k0 + cols, q.to(tl.float8e4nv), mask=ok)


def quant_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: (x_q (T, K) e4m3, s_x (T,) float32) with x ~ x_q * s_x[:, None]."""
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp_min(_EPS) / FP8_MAX
    q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quant_rows(
    x: torch.Tensor, out: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q (T, K) e4m3, s_x (T,) float32): each row of ``x`` (T, K) over its absmax / 448,
    rounded to nearest e4m3 (one Triton launch on CUDA; the twin elsewhere)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D and contiguous along K, got {tuple(x.shape)}")
    t, k = x.shape
    if out is None:
        out = torch.empty(t, k, dtype=FP8, device=x.device)
    if scale is None:
        scale = torch.empty(t, dtype=torch.float32, device=x.device)
    if out.shape != (t, k) or out.dtype != FP8 or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, want ({t}, {k}) e4m3")
    if scale.shape != (t,) or scale.dtype != torch.float32:
        raise ValueError(f"scale {tuple(scale.shape)} {scale.dtype}, want ({t},) float32")
    if t == 0:
        return out, scale
    if not triton_reaches(x):
        q, s = quant_rows_torch(x)
        out.copy_(q)
        scale.copy_(s)
        return out, scale
    block = min(4096, triton.next_power_of_2(k))
    _quant_rows_kernel[(t,)](x, out, scale, k, x.stride(0), out.stride(0), BLOCK_K=block)
    return out, scale


# -- 3. de-quantization of the GEMM's float32 result ----------------------------------------------


@functools.cache
def _dequant_kernel() -> Any:
    @triton.jit(do_not_specialize=["T"])  # (token counts met while serving: no new variant)
    def kernel(
        acc_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr, T, N, stride_acc, stride_y,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < T, cols < N
        ok = row_ok[:, None] & col_ok[None, :]
        acc = tl.load(acc_ptr + rows[:, None].to(tl.int64) * stride_acc + cols[None, :], mask=ok)
        sx = tl.load(sx_ptr + rows, mask=row_ok, other=0.0)
        sw = tl.load(sw_ptr + cols, mask=col_ok, other=0.0)
        y = (acc * sx[:, None]) * sw[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dst = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=ok)

    return kernel


def dequant_cols_torch(
    acc: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The twin: ((acc * s_x[t]) * s_w[n] (+ bias[n])) in float32, rounded once to ``dtype``."""
    y = (acc.float() * sx.float()[:, None]) * sw.float()[None, :]
    if bias is not None:
        y = y + bias[: acc.shape[1]].float()[None, :]
    return y.to(dtype)


def dequant_cols(
    acc: torch.Tensor,
    sx: torch.Tensor,
    sw: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out`` (T, N), any row stride: ``acc`` (T, N) float32 scaled per row by ``sx`` (T,)
    and per column by ``sw`` (N,) (+ ``bias`` (>= N)), rounded once to out's dtype."""
    t, n = acc.shape
    if out.shape != (t, n) or out.stride(1) != 1 or acc.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} for acc {tuple(acc.shape)}")
    if t == 0:
        return out
    if not triton_reaches(acc):
        out.copy_(dequant_cols_torch(acc, sx, sw, bias, out.dtype))
        return out
    bm, bn = 16, 256
    grid = (triton.cdiv(n, bn), triton.cdiv(t, bm))
    _dequant_kernel()[grid](
        acc, sx, sw, bias if bias is not None else sw, out, t, n, acc.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, enable_fp_fusion=False,
    )  # fmt: skip
    return out


# -- the projection ------------------------------------------------------------------------------


def _check(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    check_operands(x, weight_fp8, weight_scale, a, bias)
    if not w8a8_supported(weight_fp8, weight_scale):
        raise ValueError(
            f"W8A8 takes e4m3 weights with one scale per output channel and K, N multiples of "
            f"16; got weight {tuple(weight_fp8.shape)} {weight_fp8.dtype}, scales "
            f"{tuple(weight_scale.shape)}"
        )


def fp8_w8a8_linear_torch(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: (T, N + E) with the first N columns from the per-token quantized x against
    the fp8 weight (float32 GEMM of the de-quantized fp8 values, scales applied as
    ``dequant_cols``), the last E the A rows against x (float32, rounded once)."""
    _check(x, weight_fp8, weight_scale, a, bias)
    q, sx = quant_rows_torch(x)
    acc = q.float() @ weight_fp8.float().t()
    y = dequant_cols_torch(acc, sx, weight_scale[:, 0], bias, x.dtype)
    if a is None:
        return y
    return torch.cat([y, (x.float() @ a.float().t()).to(x.dtype)], dim=1)


_ONE: dict[torch.device, torch.Tensor] = {}


def prepare_w8a8(device: torch.device | str) -> None:
    """Make the unit scale the GEMM reads on ``device`` (start-up, before any CUDA graph
    capture: made inside one, its fill would be captured, not run)."""
    _one(torch.device(device))


def _one(device: torch.device) -> torch.Tensor:
    """A float32 scalar 1 on ``device``, made once (``cuda`` and ``cuda:<current>`` are one)."""
    return per_device(
        _ONE, device, lambda d: torch.ones((), dtype=torch.float32, device=d), "prepare_w8a8"
    )


def fp8_w8a8_linear(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, N + E): ``x`` (T, K) quantized per token against the fp8 ``weight_fp8`` (N, K) with
    per-channel ``weight_scale`` (N, 1) on the fp8 tensor cores, then against the A rows
    ``a`` (E, K) in x's dtype; ``bias`` (>= N) added to the first N columns. Four launches
    (module docstring); where ``_scaled_mm`` runs (CUDA; recent CPU builds) the same steps,
    elsewhere the twin."""
    _check(x, weight_fp8, weight_scale, a, bias)
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along K")
    t = x.shape[0]
    n = weight_fp8.shape[0]
    e = a.shape[0] if a is not None else 0
    out = aug_output(x, n + e, out)
    if t == 0:
        return out
    q, sx = quant_rows(x)
    one = _one(x.device)
    acc = torch._scaled_mm(q, weight_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    dequant_cols(acc, sx, weight_scale[:, 0], bias, out[:, :n])
    if a is not None and e:
        torch.mm(x, a.t(), out=out[:, n:])  # (cuBLAS writes the strided view in place)
    return out
