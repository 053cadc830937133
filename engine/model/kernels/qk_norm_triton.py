"""Triton: qkv LoRA epilogue + per-head q / k RMSNorm (``qk_norm.lora_qk_norm``).

Program (token block, head): the head's D columns of ``BLOCK_T`` tokens, their LoRA delta
(``lora_delta`` over the head's slice: q, k or v), DoRA's row scale where flagged, one
rounding, then for q and k heads HF's RMSNorm over the head (fp32 mean of squares, the
normalised value rounded, times the weight, rounded). Semantics: ``qk_norm.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
from loraplex.engine.model.lora.ops.delta import (
    block_r,
    dora_args,
    dora_flags,
    dora_rows,
    lora_delta,
    lora_source,
)

__all__ = ["lora_qk_norm_triton"]

BLOCK_T = 16  # a tensor-core dot for the delta (lora_delta's USE_DOT)


@triton.jit
def _qk_norm_kernel(
    ya_ptr,
    b_ptr,
    slots_ptr,
    qw_ptr,
    kw_ptr,
    out_ptr,
    T,
    N,
    HQ,
    HKV,
    D,
    L,
    R,
    eps,
    stride_yt,
    stride_yn,
    stride_bl,
    stride_bn,
    stride_br,
    stride_slot,
    stride_ot,
    stride_on,
    g_ptr,
    on_ptr,
    bias_ptr,
    stride_gl,
    stride_gn,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_DORA: tl.constexpr,
    DORA_BIAS: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < T
    tok = tok.to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    cols = head * D + d
    mask = t_mask[:, None] & d_mask[None, :]
    y = tl.load(ya_ptr + tok[:, None] * stride_yt + cols[None, :] * stride_yn, mask=mask, other=0.0)
    y = y.to(tl.float32)
    if HAS_LORA:
        s = (head >= HQ).to(tl.int32) + (head >= HQ + HKV).to(tl.int32)  # slice: q, k, v
        slots = tl.load(slots_ptr + tok * stride_slot, mask=t_mask, other=-1).to(tl.int32)
        delta = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
        delta = lora_delta(
            delta, ya_ptr, b_ptr, tok, slots, cols, d_mask, N + s * L, 1, 3 * L, L, R,
            stride_yt, stride_yn, stride_bl, stride_bn, stride_br, BLOCK_R, True,
        )  # fmt: skip
        if HAS_DORA:
            on, any_dora = dora_flags(on_ptr, slots)
            if any_dora:
                y = dora_rows(y, on, g_ptr, bias_ptr, slots, cols, d_mask, stride_gl, stride_gn,
                              DORA_BIAS)  # fmt: skip
        y = (y + delta).to(ya_ptr.dtype.element_ty).to(tl.float32)
    if head < HQ + HKV:  # q or k: RMSNorm over the head
        if head < HQ:
            w = tl.load(qw_ptr + d, mask=d_mask, other=0.0)
        else:
            w = tl.load(kw_ptr + d, mask=d_mask, other=0.0)
        ms = tl.reduce(y * y, 1, tl.standard._sum_combine) / D
        normed = y * tl.rsqrt(ms + eps)[:, None]
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = w.to(tl.float32)[None, :] * normed
    out = out_ptr + tok[:, None] * stride_ot + cols[None, :] * stride_on
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def lora_qk_norm_triton(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    num_heads: int,
    dora: DoraRows | None = None,
) -> None:
    """Triton ``lora_qk_norm`` (shapes checked by the caller)."""
    t, n = out.shape
    if t == 0:
        return
    head_dim = q_weight.shape[0]
    kv_heads = (n // head_dim - num_heads) // 2
    b, b_strides, num_slots, rank = lora_source(lora_b, y_aug)
    rank = mapping.rank_rows(rank)
    has_lora = lora_b is not None
    d_args, (has_dora, dora_bias) = dora_args(dora if has_lora else None, y_aug)
    slots = mapping.token_slots
    grid = (triton.cdiv(t, BLOCK_T), num_heads + 2 * kv_heads)
    _qk_norm_kernel[grid](
        y_aug, b, slots, q_weight, k_weight, out,
        t, n, num_heads, kv_heads, head_dim, num_slots, rank, eps,
        y_aug.stride(0), y_aug.stride(1), *b_strides, slots.stride(0),
        out.stride(0), out.stride(1), *d_args,
        BLOCK_T=BLOCK_T,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_R=block_r(rank, True),
        HAS_LORA=has_lora,
        HAS_DORA=has_dora,
        DORA_BIAS=dora_bias,
        num_warps=4,
    )  # fmt: skip
