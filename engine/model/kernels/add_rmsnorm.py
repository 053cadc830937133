"""Triton: LoRA epilogue + residual add + RMSNorm (``lora_add_rmsnorm``), and plain ``rmsnorm``.

Grid ``(cdiv(T, BLOCK_T),)``: a program owns ``BLOCK_T`` whole rows (the norm reduces over the
row). Pass 1 walks the row in ``BLOCK_H`` chunks: base + LoRA delta, residual add, store of the
new residual, sum of squares. A barrier, then pass 2 re-reads the residual it wrote (CTA-local,
so ``bar.sync`` orders it), normalises and scales. Semantics and roundings: ``reference.py``.
Nothing but ``T`` shapes the launch, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Mapping
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

__all__ = ["NormConfig", "NORM_CONFIGS", "norm_config", "lora_add_rmsnorm_triton", "rmsnorm_triton"]


@dataclass(frozen=True)
class NormConfig:
    block_t: int = 1
    block_h: int = 256
    num_warps: int = 4
    split: bool = False  # rows split over column chunks (add_rmsnorm_split.py; LoRA only)


SPLIT_RANK = 16  # steps reading more rank rows split their rows (add_rmsnorm_split.py)


def _whole_row(shape: Mapping[str, int]) -> NormConfig:
    """One row per program, the row (<= 2048 columns) in one chunk."""
    return NormConfig(block_t=1, block_h=triton.next_power_of_2(shape["hidden"]), num_warps=8)


# sm_90 (benchmarks/norm_configs.py): decode-sized batches one row per program, the whole row
# in one chunk (up to 4096) so each pass is a single load/store round trip: at hidden 4096 that
# is 2.0-2.5 µs plain / 5.0-5.7 µs with 8 LoRA slots, against 3.5-3.8 / 7.3-8.2 µs for
# 1024-wide chunks and ~10 / ~14 µs for 256-wide ones. Larger batches: 4-row blocks (one B tile
# load per slot and block). Steps reading more than SPLIT_RANK rank rows at decode sizes split
# each row over 1024-column chunks: one program per row read all of a row's B slice (512 KB at
# rank 64 and hidden 4096) through one SM (add_rmsnorm_split.py, whose workspace bounds the
# rows to 256 and the chunks to 64). 8 rank-64 slots, T = 32 / 64: 7.2 / 12.2 µs, against
# 8.4 / 13.7 for 512-column chunks and 14.8 for whole rows (``--ranks 64``); beyond 32 rows,
# blocks of two rows (rows come grouped by slot: a pair mostly shares its B chunk): 9.3 µs at
# T = 64, 9.0 at T = 32.
_SPLIT = {"rank": (SPLIT_RANK + 1, None), "hidden": (None, 1024 * 64)}
_SM90: tuple[Rule[NormConfig], ...] = (
    Rule(NormConfig(1, 1024, 8, split=True), tokens=(None, 32), **_SPLIT),
    Rule(NormConfig(2, 1024, 8, split=True), tokens=(None, 256), **_SPLIT),
    Rule(NormConfig(1, 4096, 16), tokens=(None, 256), hidden=(2049, None)),
    Rule(_whole_row, tokens=(None, 256)),
    Rule(NormConfig(4, 64, 4)),
)
# Generic: the sm_90 rows. They take at most 16 KB of shared memory (compiled for sm_80, sm_86
# and sm_90), so they run on any GPU; other GPUs' fastest configs were not measured.
NORM_CONFIGS = LaunchTable("add_rmsnorm", {"sm90": _SM90, GENERIC: _SM90})


def norm_config(
    num_tokens: int, hidden: int = 4096, rank: int = 0, device: torch.device | str | None = None
) -> NormConfig:
    """The launch for ``num_tokens`` rows of ``hidden`` columns with a LoRA delta of ``rank``
    rank rows (0: none) on ``device`` (None: the generic rows); ``NORM_CONFIGS``."""
    return NORM_CONFIGS.pick(device, tokens=num_tokens, hidden=hidden, rank=rank)


@triton.jit
def _add_rmsnorm_kernel(
    ya_ptr,
    res_ptr,
    b_ptr,
    slots_ptr,
    w_ptr,
    out_ptr,
    T,
    H,
    L,
    R,
    eps,
    stride_yt,
    stride_yn,
    stride_rt,
    stride_rn,
    stride_bl,
    stride_bn,
    stride_br,
    stride_slot,
    stride_w,
    stride_ot,
    stride_on,
    g_ptr,
    on_ptr,
    bias_ptr,
    stride_gl,
    stride_gn,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ADD: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_DORA: tl.constexpr,
    DORA_BIAS: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < T
    tok = tok.to(tl.int64)
    if HAS_LORA:
        slots = tl.load(slots_ptr + tok * stride_slot, mask=t_mask, other=-1).to(tl.int32)
    else:
        slots = tl.full((BLOCK_T,), -1, tl.int32)
    if HAS_DORA:
        on, any_dora = dora_flags(on_ptr, slots)
    r_rows = res_ptr + tok[:, None] * stride_rt
    sumsq = tl.full((BLOCK_T,), 0.0, tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        c_mask = cols < H
        mask = t_mask[:, None] & c_mask[None, :]
        r = tl.load(r_rows + cols[None, :] * stride_rn, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            y_ptrs = ya_ptr + tok[:, None] * stride_yt + cols[None, :] * stride_yn
            y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            if HAS_LORA:
                acc = tl.full((BLOCK_T, BLOCK_H), 0.0, tl.float32)
                acc = lora_delta(
                    acc, ya_ptr, b_ptr, tok, slots, cols, c_mask, H, 1, L, L, R,
                    stride_yt, stride_yn, stride_bl, stride_bn, stride_br,
                    BLOCK_R, USE_DOT,
                )  # fmt: skip
                if HAS_DORA:  # noqa: SIM102 (any_dora exists only under the constexpr)
                    if any_dora:
                        y = dora_rows(
                            y, on, g_ptr, bias_ptr, slots, cols, c_mask, stride_gl, stride_gn,
                            DORA_BIAS,
                        )  # fmt: skip
                y = (y + acc).to(ya_ptr.dtype.element_ty).to(tl.float32)
            r = (r + y).to(res_ptr.dtype.element_ty)
            tl.store(r_rows + cols[None, :] * stride_rn, r, mask=mask)
            r = r.to(tl.float32)
        sumsq += tl.reduce(r * r, 1, tl.standard._sum_combine)
    if ADD:
        tl.debug_barrier()  # pass 2 re-reads residual elements other threads stored
    inv = tl.rsqrt(sumsq / H + eps)
    o_rows = out_ptr + tok[:, None] * stride_ot
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        c_mask = cols < H
        mask = t_mask[:, None] & c_mask[None, :]
        r = tl.load(r_rows + cols[None, :] * stride_rn, mask=mask, other=0.0).to(tl.float32)
        normed = (r * inv[:, None]).to(res_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols * stride_w, mask=c_mask, other=0.0).to(tl.float32)
        out = (w[None, :] * normed).to(out_ptr.dtype.element_ty)
        tl.store(o_rows + cols[None, :] * stride_on, out, mask=mask)


def _launch(
    y_aug: torch.Tensor | None,
    residual: torch.Tensor,
    lora_b: torch.Tensor | None,
    token_slots: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    config: NormConfig | None,
    rank_bound: int | None = None,
    dora: DoraRows | None = None,
) -> None:
    t, h = residual.shape
    if t == 0:
        return
    has_lora = lora_b is not None
    ya = y_aug if y_aug is not None else residual
    b, b_strides, num_slots, rank = lora_source(lora_b, ya)
    if rank_bound is not None:
        rank = min(rank, rank_bound)  # the step's rank rows (model/lora/ranks.py)
    lora_rank = rank if lora_b is not None and y_aug is not None else 0
    cfg = config or norm_config(t, h, lora_rank, residual.device)
    use_dot = cfg.block_t >= 16
    dora = dora if has_lora and y_aug is not None else None
    if cfg.split:
        from loraplex.engine.model.kernels.add_rmsnorm_split import add_rmsnorm_split

        assert y_aug is not None and token_slots is not None
        add_rmsnorm_split(
            y_aug, residual, lora_b, token_slots, norm_weight, eps, out, rank=rank,
            block_h=cfg.block_h, num_warps=cfg.num_warps, block_t=cfg.block_t,
            block_r=block_r(rank, use_dot, cfg.block_t * cfg.block_h, cfg.num_warps), dora=dora,
        )  # fmt: skip
        return
    slots = token_slots if token_slots is not None else ya
    d_args, (has_dora, dora_bias) = dora_args(dora, ya)
    _add_rmsnorm_kernel[(triton.cdiv(t, cfg.block_t),)](
        ya,
        residual,
        b,
        slots,
        norm_weight,
        out,
        t,
        h,
        num_slots,
        rank,
        eps,
        ya.stride(0),
        ya.stride(1),
        residual.stride(0),
        residual.stride(1),
        *b_strides,
        slots.stride(0) if token_slots is not None else 0,
        norm_weight.stride(0),
        out.stride(0),
        out.stride(1),
        *d_args,
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h,
        BLOCK_R=block_r(rank, use_dot, cfg.block_t * cfg.block_h, cfg.num_warps),
        ADD=y_aug is not None,
        HAS_LORA=has_lora,
        USE_DOT=use_dot,
        HAS_DORA=has_dora,
        DORA_BIAS=dora_bias,
        num_warps=cfg.num_warps,
    )


def lora_add_rmsnorm_triton(
    y_aug: torch.Tensor,
    residual: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    dora: DoraRows | None = None,
    *,
    config: NormConfig | None = None,
) -> None:
    """Triton ``lora_add_rmsnorm``; see ``reference.lora_add_rmsnorm_torch``."""
    _launch(
        y_aug, residual, lora_b, mapping.token_slots, norm_weight, eps, out, config,
        mapping.rank_bound, dora,
    )  # fmt: skip


def rmsnorm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    *,
    config: NormConfig | None = None,
) -> None:
    """Triton ``rmsnorm``; see ``reference.rmsnorm_torch``."""
    _launch(None, x, None, None, weight, eps, out, config)
