"""Triton: gate_up LoRA epilogue + SiLU-and-mul (``lora_silu_mul``).

Grid ``(cdiv(T, BLOCK_T), cdiv(I, BLOCK_N))``: each program owns a ``BLOCK_T x BLOCK_N`` tile of
the output, i.e. the same columns of the gate and of the up slice. ``BLOCK_T`` is 16 so the
LoRA delta is a tensor-core dot, and tokens of the block that share an adapter share its B tile
(see ``lora_delta``). Semantics and roundings: ``reference.lora_silu_mul_torch``. Nothing but
``T`` shapes the launch, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.launch_table import GENERIC, LaunchTable, Rule
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
from loraplex.engine.model.lora.ops.delta import (
    block_r,
    dora_args,
    dora_flags,
    dora_rows,
    lora_delta,
    lora_source,
)

__all__ = ["SiluMulConfig", "SILU_MUL_CONFIGS", "silu_mul_config", "lora_silu_mul_triton"]


@dataclass(frozen=True)
class SiluMulConfig:
    block_t: int = 16
    block_n: int = 128
    num_warps: int = 4
    block_k: int = 0  # > 0: packed LoRA delta (one dot per BLOCK_K rank columns, lora_delta)


# The fastest configs of ``benchmarks/epilogue_configs.py`` on sm_90 (bf16, rows grouped by
# slot): the packed delta up to 32 tokens (8 slots: 5.1 vs 8.1 µs at T = 8, 5.4 vs 6.1 at
# T = 32), the per-slot loop at T = 64 (5.5 µs), 64-token packed blocks for many slots beyond
# (13.6 vs 16.3 µs at T = 128 with 32 slots); ptxas, R = 16: 114 registers (16 x 64, 4 warps),
# 126 (16 x 128, 8 warps). Steps reading more than 16 rank rows with fewer than 16 slots (timed
# with 8; more slots keep the rank-16 choices): up to 32 tokens the per-slot loop over 16 x 128
# tiles, 11.1 against 16.0 µs for the packed delta at T = 32 with 8 rank-64 slots (the packed
# form's dot spans every slot's rank columns of the block); at T = 64 the packed delta in
# 32-column chunks on 16 x 128 tiles, 13.8 against 18.3 µs.
_SM90: tuple[Rule[SiluMulConfig], ...] = (
    Rule(SiluMulConfig(16, 128, 4), slots=(1, 15), tokens=(None, 32), rank=(17, None)),
    Rule(SiluMulConfig(16, 128, 4, block_k=32), slots=(1, 15), tokens=(None, 64), rank=(17, None)),
    Rule(SiluMulConfig(16, 64, 4, block_k=64), slots=(1, None), tokens=(None, 32)),
    Rule(SiluMulConfig(16, 64, 4), tokens=(None, 64)),
    Rule(SiluMulConfig(64, 128, 4, block_k=64), slots=(16, None)),
    Rule(SiluMulConfig(16, 64, 4), slots=(1, None)),
    Rule(SiluMulConfig(16, 128, 8)),
)
# Generic: the sm_90 rows. Their tiles take at most 56 KB of shared memory (compiled for sm_80,
# sm_86 and sm_90), so they run on any GPU; other GPUs' fastest configs were not measured.
SILU_MUL_CONFIGS = LaunchTable("silu_mul", {"sm90": _SM90, GENERIC: _SM90})


def silu_mul_config(
    num_tokens: int, num_slots: int = 0, rank: int = 16, device: torch.device | str | None = None
) -> SiluMulConfig:
    """The launch for ``num_tokens`` rows over ``num_slots`` slots reading ``rank`` rank rows
    on ``device`` (None: the generic rows); ``SILU_MUL_CONFIGS``."""
    return SILU_MUL_CONFIGS.pick(device, tokens=num_tokens, slots=num_slots, rank=rank)


@triton.jit
def _silu_mul_kernel(
    ya_ptr,
    b_ptr,
    slots_ptr,
    out_ptr,
    T,
    inter,
    L,
    R,
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
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_DORA: tl.constexpr,
    DORA_BIAS: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < T
    tok = tok.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < inter
    mask = t_mask[:, None] & c_mask[None, :]
    y_rows = ya_ptr + tok[:, None] * stride_yt
    g = tl.load(y_rows + cols[None, :] * stride_yn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(y_rows + (inter + cols)[None, :] * stride_yn, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        slots = tl.load(slots_ptr + tok * stride_slot, mask=t_mask, other=-1).to(tl.int32)
        dg = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
        du = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
        dg = lora_delta(
            dg, ya_ptr, b_ptr, tok, slots, cols, c_mask, 2 * inter, 1, 2 * L, L, R,
            stride_yt, stride_yn, stride_bl, stride_bn, stride_br, BLOCK_R, USE_DOT, BLOCK_K,
        )  # fmt: skip
        du = lora_delta(
            du, ya_ptr, b_ptr, tok, slots, inter + cols, c_mask, 2 * inter + L, 1, 2 * L, L, R,
            stride_yt, stride_yn, stride_bl, stride_bn, stride_br, BLOCK_R, USE_DOT, BLOCK_K,
        )  # fmt: skip
        if HAS_DORA:  # after the deltas: their loads go out before the flag gather
            on, any_dora = dora_flags(on_ptr, slots)
            if any_dora:
                g = dora_rows(
                    g, on, g_ptr, bias_ptr, slots, cols, c_mask, stride_gl, stride_gn, DORA_BIAS
                )
                u = dora_rows(
                    u, on, g_ptr, bias_ptr, slots, inter + cols, c_mask, stride_gl, stride_gn,
                    DORA_BIAS,
                )  # fmt: skip
        g = (g + dg).to(ya_ptr.dtype.element_ty).to(tl.float32)
        u = (u + du).to(ya_ptr.dtype.element_ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(ya_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + tok[:, None] * stride_ot + cols[None, :] * stride_on,
        (act * u).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def lora_silu_mul_triton(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    out: torch.Tensor,
    dora: DoraRows | None = None,
    *,
    config: SiluMulConfig | None = None,
) -> None:
    """Triton ``lora_silu_mul``; see ``reference.lora_silu_mul_torch``."""
    t = y_aug.shape[0]
    if t == 0:
        return
    b, b_strides, num_slots, rank = lora_source(lora_b, y_aug)
    rank = mapping.rank_rows(rank)  # the step's rank rows (model/lora/ranks.py)
    cfg = config or silu_mul_config(t, num_slots, rank, y_aug.device)
    use_dot = cfg.block_t >= 16
    inter = out.shape[1]
    slots = mapping.token_slots
    has_lora = lora_b is not None
    d_args, (has_dora, dora_bias) = dora_args(dora if has_lora else None, y_aug)
    grid = (triton.cdiv(t, cfg.block_t), triton.cdiv(inter, cfg.block_n))
    _silu_mul_kernel[grid](
        y_aug,
        b,
        slots,
        out,
        t,
        inter,
        num_slots,
        rank,
        y_aug.stride(0),
        y_aug.stride(1),
        *b_strides,
        slots.stride(0),
        out.stride(0),
        out.stride(1),
        *d_args,
        BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_n,
        BLOCK_R=block_r(rank, use_dot, cfg.block_t * cfg.block_n, cfg.num_warps),
        HAS_LORA=has_lora,
        USE_DOT=use_dot,
        BLOCK_K=cfg.block_k if use_dot else 0,
        HAS_DORA=has_dora,
        DORA_BIAS=dora_bias,
        num_warps=cfg.num_warps,
    )
