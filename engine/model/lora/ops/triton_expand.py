"""Triton grouped LoRA expand: ``y[t, slice s] += shrunk[s, t, :rank] @ B[slot(t), slice s].T``
for all segments and slices in one launch.

Grid: ``(token tiles x N tiles of the widest slice, segments, slices)``; programs past the end
of a narrower slice or a shorter segment exit at once. The K dimension is the rank: loads of
``shrunk`` and ``B`` are masked to the segment's rank, so columns beyond it are never read.
Math: fp32 accumulation, one rounding into ``y``'s dtype. With a 16-bit ``B`` the fp32
intermediate is split into hi + lo parts of ``B``'s dtype and multiplied by two tensor-core dots
(about 16 mantissa bits for bfloat16; an fp32 FMA dot costs far more registers); ``fast_h``
keeps only the hi part. Up to ``MAX_SLICES`` slices per launch (bounds passed as scalars, so the
launch is CUDA-graph safe); more slices take more launches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.launch_table import GENERIC, LaunchTable, Rule, device_sms
from loraplex.engine.model.lora.mapping import LoRAMapping

__all__ = ["EXPAND_CONFIGS", "ExpandConfig", "expand_config", "expand_triton", "MAX_SLICES"]

MAX_SLICES = 4


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int = 16
    block_n: int = 128
    block_r: int = 16
    fast_h: bool = False  # round shrunk to B's dtype: one dot instead of two (16-bit B only)
    num_warps: int = 4
    num_stages: int = 2


def _tiles(shape: Mapping[str, int]) -> ExpandConfig:
    """Tile sizes: N tiles of 128, narrowed while the grid is under ~2 waves of the SMs.

    The rank is looped over in chunks of 16, so any rank takes the same tiles (the rank is not
    a dimension of the table): register use (sm_90, bf16, 4 warps) is ~80 regs at 16x128x16
    and ~160 at 32x128x16, but ~250 with spills at a 64-wide rank chunk.
    """
    seg_len = shape["tokens"]
    block_m = 16 if seg_len <= 16 else 32
    block_r = 16
    grid = triton.cdiv(max(seg_len, 1), block_m) * max(shape["segments"], 1) * shape["slices"]
    block_n = 128
    while block_n > 32 and grid * triton.cdiv(shape["width"], block_n) < 2 * shape["sms"]:
        block_n //= 2
    return ExpandConfig(block_m=block_m, block_n=block_n, block_r=block_r)


# sm_90: the tiles the kernel was tuned with; elsewhere the same (a few KB of shared memory)
EXPAND_CONFIGS: LaunchTable[ExpandConfig] = LaunchTable(
    "lora_expand", {"sm90": (Rule(_tiles),), GENERIC: (Rule(_tiles),)}
)


def expand_config(
    max_seg_len: int,
    num_segments: int,
    num_slices: int,
    max_width: int,
    device: torch.device | str | None = None,
) -> ExpandConfig:
    """The launch for segments of up to ``max_seg_len`` tokens into slices of up to
    ``max_width`` columns on ``device`` (None: the generic rows); ``EXPAND_CONFIGS``."""
    sms = device_sms(torch.device(device)) if device is not None else 132
    return EXPAND_CONFIGS.pick(
        device, tokens=max_seg_len, segments=num_segments, slices=num_slices, width=max_width,
        sms=sms,
    )  # fmt: skip


@triton.jit
def _expand_kernel(
    y_ptr,
    sh_ptr,
    b_ptr,
    ids_ptr,
    seg_slots_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_ranks_ptr,
    R,
    n_tiles,
    slice_base,
    off0,
    off1,
    off2,
    off3,
    off4,
    stride_ym,
    stride_yn,
    stride_ss,
    stride_sm,
    stride_sr,
    stride_bl,
    stride_bn,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_H: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    ps = tl.program_id(2)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles

    seg_len = tl.load(seg_lens_ptr + g)
    m0 = pid_m * BLOCK_M
    if m0 >= seg_len:
        return
    # Column range of this slice: [n_lo, n_hi).
    n_lo = tl.where(ps == 0, off0, tl.where(ps == 1, off1, tl.where(ps == 2, off2, off3)))
    n_hi = tl.where(ps == 0, off1, tl.where(ps == 1, off2, tl.where(ps == 2, off3, off4)))
    n0 = n_lo + pid_n * BLOCK_N
    if n0 >= n_hi:
        return
    s = (slice_base + ps).to(tl.int64)
    start = tl.load(seg_starts_ptr + g)
    slot = tl.load(seg_slots_ptr + g).to(tl.int64)
    rank = tl.minimum(tl.load(seg_ranks_ptr + g), R)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # (BLOCK_M,)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi

    sh_rows = sh_ptr + s * stride_ss + tok[:, None] * stride_sm  # (BLOCK_M, 1)
    b_cols = b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn  # (1, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # not tl.zeros: see triton_shrink's doc
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        h = tl.load(
            sh_rows + offs_r[None, :] * stride_sr, mask=m_mask[:, None] & r_mask[None, :], other=0.0
        )  # (BLOCK_M, BLOCK_R) fp32
        b = tl.load(
            b_cols + offs_r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0
        )  # (BLOCK_R, BLOCK_N)
        if SPLIT_H:
            # h = hi + lo in B's 16-bit dtype: two tensor-core dots, ~fp32-accurate (B is exact).
            h_hi = h.to(b.dtype)
            h_lo = (h - h_hi.to(tl.float32)).to(b.dtype)
            acc += tl.dot(h_hi, b)
            acc += tl.dot(h_lo, b)
        else:
            acc += tl.dot(h.to(b.dtype), b, input_precision=FP32_PRECISION)

    y_ptrs = y_ptr + tok[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def expand_triton(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: Sequence[int],
    mapping: LoRAMapping,
    *,
    config: ExpandConfig | None = None,
    fp32_precision: str = "ieee",
) -> None:
    """Triton ``lora_expand``; see ``reference.expand_torch`` for the semantics."""
    num_slices = len(slice_offsets) - 1
    max_rank = lora_b.shape[2]
    num_segments = mapping.num_segments
    if num_segments == 0 or mapping.max_seg_len == 0:
        return
    widths = [slice_offsets[i + 1] - slice_offsets[i] for i in range(num_slices)]
    if config is None:
        config = expand_config(mapping.max_seg_len, num_segments, num_slices, max(widths), y.device)
    m_tiles = triton.cdiv(mapping.max_seg_len, config.block_m)
    for base in range(0, num_slices, MAX_SLICES):
        count = min(MAX_SLICES, num_slices - base)
        bounds = list(slice_offsets[base : base + count + 1])
        bounds += [bounds[-1]] * (MAX_SLICES + 1 - len(bounds))  # (MAX_SLICES + 1,)
        n_tiles = triton.cdiv(max(widths[base : base + count]), config.block_n)
        grid = (m_tiles * n_tiles, num_segments, count)
        _expand_kernel[grid](
            y,
            shrunk,
            lora_b,
            mapping.sorted_token_ids,
            mapping.seg_slots,
            mapping.seg_starts,
            mapping.seg_lens,
            mapping.seg_ranks,
            max_rank,
            n_tiles,
            base,
            *bounds,
            y.stride(0),
            y.stride(1),
            *shrunk.stride(),
            *lora_b.stride(),
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_r,
            SPLIT_H=lora_b.dtype != torch.float32 and not config.fast_h,
            FP32_PRECISION=fp32_precision,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
