"""Triton: the augmented projection GEMM of an fp8 base (``fp8_aug_linear``).

An fp8 base keeps each projection's weight as e4m3 values with float32 scales
(``quant.py``: ``weight_fp8`` (N, K), ``weight_scale`` (N, G), group = K // G) and the LoRA A
rows of every slot in bfloat16 (``LoRALinear.lora_a``, E = S * L * R rows). Decode is bound by
reading the weights, so the GEMM reads the fp8 bytes as they are and converts them to the
activations' dtype in registers (weight-only quantization, W8A16): half the bytes of a bf16
weight, no activation quantization, the same tensor-core dot. One launch writes the same
(T, N + E) output as the bf16 augmented GEMM (``x @ [W; A].T``), so the fused epilogues read
it unchanged:

    y[t, n]     = sum_k x[t, k] * weight_fp8[n, k] * weight_scale[n, k // group]  (+ bias[n])
    y[t, N + e] = sum_k x[t, k] * a[e, k]

Grid ``(cdiv(N, BLOCK_N) + cdiv(E, BLOCK_N), cdiv(T, BLOCK_M))``: the first programs own base
column tiles, the rest A-row tiles. Each program accumulates in float32 over K; per-channel
scales (G = 1) multiply once at the end, group scales once per K tile (group a multiple of
BLOCK_K). Nothing but ``T`` shapes the launch, so it can be captured in a CUDA graph.
Semantics: ``fp8_aug_linear_torch`` (the twin: de-quantize, then one float32 GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["Fp8LinearConfig", "fp8_linear_config", "fp8_aug_linear", "fp8_aug_linear_torch"]


@dataclass(frozen=True)
class Fp8LinearConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4


def fp8_linear_config(num_tokens: int, n: int, k: int, group: int) -> Fp8LinearConfig:
    """The launch configuration for ``num_tokens`` rows against an (n, k) fp8 weight whose
    scale groups span ``group`` columns of K (BLOCK_K must divide it)."""
    block_m = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    # a first pick from the H200 sweep of benchmarks/fp8_gemm.py (BENCHMARKS.md); wide K
    # tiles only for few rows (shared memory: stages x (BLOCK_M x BLOCK_K x 2 + BLOCK_K x
    # BLOCK_N) bytes must stay under 227 KB)
    block_k = 256 if block_m == 16 and group % 256 == 0 else 128
    block_k = min(block_k, triton.next_power_of_2(k))
    block_n = 32 if block_m == 16 else 64
    stages = 3 if block_m == 16 else 4
    return Fp8LinearConfig(block_m, block_n, block_k, num_warps=4, num_stages=stages)


@triton.jit(do_not_specialize=["T"])
def _fp8_aug_linear_kernel(
    x_ptr,
    wq_ptr,
    ws_ptr,
    a_ptr,
    bias_ptr,
    y_ptr,
    T,
    N,
    E,
    K,
    stride_xt,
    stride_wn,
    stride_sn,
    stride_an,
    stride_yt,
    GROUP: tl.constexpr,  # K columns per scale
    PER_CHANNEL: tl.constexpr,  # one scale per output channel (G = 1)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    base_tiles = tl.cdiv(N, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if pid_n < base_tiles:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + offs_k
            k_ok = kk < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xt + kk[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                wq_ptr + cols[None, :] * stride_wn + kk[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            part = tl.dot(x, w.to(x.dtype))
            if PER_CHANNEL:
                acc += part
            else:
                s = tl.load(ws_ptr + cols * stride_sn + k0 // GROUP, mask=col_ok, other=0.0)
                acc += part * s[None, :]
        if PER_CHANNEL:
            s = tl.load(ws_ptr + cols * stride_sn, mask=col_ok, other=0.0)
            acc = acc * s[None, :]
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
            acc += b.to(tl.float32)[None, :]
        out_cols = cols
    else:
        ecols = (pid_n - base_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = ecols < E
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            kk = k0 + offs_k
            k_ok = kk < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xt + kk[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            a = tl.load(
                a_ptr + ecols[None, :] * stride_an + kk[:, None],
                mask=col_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            acc += tl.dot(x, a)
        out_cols = N + ecols
    tl.store(
        y_ptr + rows[:, None] * stride_yt + out_cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _check(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> int:
    """The scale group (K columns per scale); raises ValueError on inconsistent shapes."""
    if x.dim() != 2 or weight_fp8.dim() != 2 or x.shape[1] != weight_fp8.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} against weight {tuple(weight_fp8.shape)}")
    n, k = weight_fp8.shape
    if weight_scale.dim() != 2 or weight_scale.shape[0] != n or k % weight_scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} for weight ({n}, {k})")
    if a is not None and (a.dim() != 2 or a.shape[1] != k or a.dtype != x.dtype):
        raise ValueError(f"A rows {tuple(a.shape)} {a.dtype}, want (E, {k}) {x.dtype}")
    if bias is not None and bias.shape[0] < n:
        raise ValueError(f"bias {tuple(bias.shape)} shorter than {n}")
    return k // weight_scale.shape[1]


def fp8_aug_linear_torch(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: (T, N + E) = x @ [de-quantized W; A].T (+ bias on the first N), computed in
    float32 and rounded once to x's dtype."""
    group = _check(x, weight_fp8, weight_scale, a, bias)
    w = weight_fp8.float() * weight_scale.float().repeat_interleave(group, dim=1)
    if a is not None:
        w = torch.cat([w, a.float()])
    y = x.float() @ w.t()
    if bias is not None:
        y[:, : weight_fp8.shape[0]] += bias[: weight_fp8.shape[0]].float()
    return y.to(x.dtype)


def fp8_aug_linear(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: Fp8LinearConfig | None = None,
) -> torch.Tensor:
    """(T, N + E): ``x`` (T, K) against fp8 ``weight_fp8`` (N, K) with ``weight_scale``
    (N, G) float32, then against the A rows ``a`` (E, K) in x's dtype; ``bias`` (>= N) added
    to the first N columns. One Triton launch (see the module docstring)."""
    group = _check(x, weight_fp8, weight_scale, a, bias)
    if x.stride(1) != 1 or weight_fp8.stride(1) != 1 or (a is not None and a.stride(1) != 1):
        raise ValueError("x, weight_fp8 and A rows must be contiguous along K")
    t, k = x.shape
    n = weight_fp8.shape[0]
    e = a.shape[0] if a is not None else 0
    cfg = config or fp8_linear_config(t, n, k, group)
    if group != k and group % cfg.block_k:
        raise ValueError(f"scale group {group} is not a multiple of BLOCK_K {cfg.block_k}")
    y = torch.empty(t, n + e, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    grid = (triton.cdiv(n, cfg.block_n) + triton.cdiv(e, cfg.block_n), triton.cdiv(t, cfg.block_m))
    _fp8_aug_linear_kernel[grid](
        x, weight_fp8, weight_scale,
        a if a is not None else x, bias if bias is not None else x, y,
        t, n, e, k,
        x.stride(0), weight_fp8.stride(0), weight_scale.stride(0),
        a.stride(0) if a is not None else 0, y.stride(0),
        GROUP=group, PER_CHANNEL=group == k, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )  # fmt: skip
    return y
