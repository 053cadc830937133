"""Triton: every row's LoRA delta of one projection, on its own (``lora_expand_delta``).

The fused epilogues add the delta inside the op after the projection (``lora_delta``). This
launch computes the same delta into an fp32 (T, N) buffer instead, from the step's shrinks held
apart from the base output: ``shrink`` (T, Rb * S * L), rank-major, ``shrink[t, (r * S + s) * L
+ l] = x[t] . A[s, l, r]`` (an augmented GEMM's columns right of its base columns, or a GEMM of
the A rows alone). What it is for: a delta that does not wait for the base GEMM can run beside
it, on a side stream of the step's graph, so that its B reads fill the bandwidth the skinny base
GEMM leaves (``benchmarks/lora_overlap.py`` measures whether they do).

Grid ``(cdiv(T, BLOCK_T), cdiv(N, BLOCK_N))``; a column block spanning two slices runs one
masked ``lora_delta`` per slice it touches (the other columns add exact zeros), so any slice
widths work; blocks inside one slice run one. Rows of slot -1 get 0. Semantics and fp32 sums:
``lora_expand_delta_torch`` (the per-slice ``reference.lora_delta_torch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.lora.ops.delta import block_r, lora_delta

__all__ = ["ExpandDeltaConfig", "lora_expand_delta", "lora_expand_delta_torch", "MAX_SLICES"]

MAX_SLICES = 3


@dataclass(frozen=True)
class ExpandDeltaConfig:
    block_t: int = 16
    block_n: int = 128
    num_warps: int = 4
    stages: int = 2  # > 0: lora_delta's pipelined per-slot loop (B tiles in flight)


@triton.jit
def _expand_delta_kernel(
    sh_ptr, b_ptr, slots_ptr, out_ptr, T, N, L, R, S, off1, off2,
    stride_st, stride_sn, stride_bl, stride_bn, stride_br, stride_slot, stride_ot, stride_on,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, USE_DOT: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < T
    tok = tok.to(tl.int64)
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    c_mask = cols < N
    slots = tl.load(slots_ptr + tok * stride_slot, mask=t_mask, other=-1).to(tl.int32)
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    col1 = tl.minimum(col0 + BLOCK_N, N)  # one past the block's last column
    for s in tl.static_range(3):
        if s == 0:
            lo = 0
            hi = off1
        elif s == 1:
            lo = off1
            hi = off2
        else:
            lo = off2
            hi = N
        if (s < S) & (col0 < hi) & (col1 > lo):
            acc = lora_delta(
                acc, sh_ptr, b_ptr, tok, slots, cols, c_mask & (cols >= lo) & (cols < hi),
                s * L, 1, S * L, L, R, stride_st, stride_sn, stride_bl, stride_bn, stride_br,
                BLOCK_R, USE_DOT, 0, STAGES,
            )  # fmt: skip
    mask = t_mask[:, None] & c_mask[None, :]
    tl.store(out_ptr + tok[:, None] * stride_ot + cols[None, :] * stride_on, acc, mask=mask)


def _check(
    shrink: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping, offsets: Sequence[int],
    out: torch.Tensor,
) -> int:  # fmt: skip
    """The step's rank rows; raises on shapes that do not fit together."""
    num_slices = len(offsets) - 1
    if not 1 <= num_slices <= MAX_SLICES or offsets[0] != 0 or list(offsets) != sorted(offsets):
        raise ValueError(f"slice offsets {tuple(offsets)}: 0 first, ascending, 1-3 slices")
    if lora_b.dim() != 3 or lora_b.shape[1] != offsets[-1]:
        raise ValueError(f"lora_b {tuple(lora_b.shape)}, want (L, {offsets[-1]}, R)")
    num_slots, n, rank = lora_b.shape
    rows = mapping.rank_rows(rank)
    t = mapping.token_slots.shape[0]
    if shrink.dim() != 2 or shrink.shape[0] != t or shrink.shape[1] < rows * num_slices * num_slots:
        raise ValueError(
            f"shrink {tuple(shrink.shape)}, want ({t}, >= {rows * num_slices * num_slots})"
        )
    if tuple(out.shape) != (t, n) or out.dtype != torch.float32:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, want ({t}, {n}) float32")
    if shrink.dtype != lora_b.dtype:
        raise ValueError(f"shrink dtype {shrink.dtype} != lora_b dtype {lora_b.dtype}")
    return rows


def lora_expand_delta_torch(
    shrink: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping, offsets: Sequence[int],
    out: torch.Tensor,
) -> None:  # fmt: skip
    """``out[t, lo_s + j] = delta_s[t, j]`` (fp32) for every slice ``s`` of ``offsets``."""
    from loraplex.engine.model.lora.ops.delta import lora_delta_torch

    _check(shrink, lora_b, mapping, offsets, out)
    num_slices = len(offsets) - 1
    for s in range(num_slices):
        lo, hi = offsets[s], offsets[s + 1]
        out[:, lo:hi] = lora_delta_torch(shrink, 0, lora_b, mapping, s, lo, hi, num_slices)


def lora_expand_delta(
    shrink: torch.Tensor,
    lora_b: torch.Tensor,
    mapping: LoRAMapping,
    offsets: Sequence[int],
    out: torch.Tensor,
    *,
    config: ExpandDeltaConfig | None = None,
) -> None:
    """Every row's delta of a projection with slices at ``offsets`` (0, ..., N) into ``out``
    (T, N) fp32: the Triton kernel if ``mapping.triton``, else its twin."""
    if not mapping.triton:
        lora_expand_delta_torch(shrink, lora_b, mapping, offsets, out)
        return
    rank = _check(shrink, lora_b, mapping, offsets, out)
    t, n = out.shape
    if t == 0:
        return
    cfg = config or ExpandDeltaConfig()
    use_dot = cfg.block_t >= 16
    bounds = list(offsets[1:-1]) + [n] * (MAX_SLICES - len(offsets) + 1)
    slots = mapping.token_slots
    grid = (triton.cdiv(t, cfg.block_t), triton.cdiv(n, cfg.block_n))
    _expand_delta_kernel[grid](
        shrink, lora_b, slots, out, t, n, lora_b.shape[0], rank, len(offsets) - 1, *bounds[:2],
        shrink.stride(0), shrink.stride(1), *lora_b.stride(), slots.stride(0), out.stride(0),
        out.stride(1), BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        BLOCK_R=block_r(rank, use_dot, cfg.block_t * cfg.block_n, cfg.num_warps),
        USE_DOT=use_dot, STAGES=cfg.stages, num_warps=cfg.num_warps,
    )  # fmt: skip
