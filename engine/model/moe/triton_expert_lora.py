"""Triton: the expert LoRA delta over the expert-sorted pairs (``expert_lora.expert_lora_delta``).

Two launches over the blocks of ``routing.ExpertBlocks`` (the grouped expert GEMM's own sort:
every block holds ``block_m`` pairs of one expert), each pair with its token's slot
(``token_slots[pair // top_k]``)::

    shrink  grid (B, S*R tiles):     h[p, :S*R] = x[p // a_div] @ A[slot, e, :S*R].T   (float32)
    expand  grid (B, S * N/S tiles): out[p, slice j] += h[p, j*R : j*R + rank] @ B^T[slot, e, ...]
                                     (the rank looped over in chunks of 16, as the dense expand)

A program loops over the slots: for each slot some of its block's pairs hold, one dot over
those rows (the others load as zeros, read nothing) against that slot's (expert) weights, masked
to the slot's rank (``ranks``: 0 where a slot holds no expert weights). Pairs of base rows (slot
-1), of slots >= L (no expert storage: ``max_expert_loras``) and of slots of rank 0 are neither
computed nor stored: their ``out`` rows keep their bits.
``h``: (P, S*R) float32 scratch, one row a pair, written only where a pair takes a delta.

Roundings as the twin's (``expert_lora_delta_torch``): float32 accumulation, one rounding into
``out``'s dtype. The expand's float32 ``h`` times a 16-bit ``B`` is two tensor-core dots (``h``
split into hi + lo parts of B's dtype), as the dense expand (``lora/ops/triton_expand.py``).

Every shape depends on P, E, L, R and the block size (no host sync): CUDA-graph capturable. P is
not specialised on (``do_not_specialize``). Only Triton builtins in the kernels (see
``lora/ops/triton_shrink.py``: ``tl.zeros`` refuses to run under a late ``TRITON_INTERPRET``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.launch_table import GENERIC, LaunchTable, Rule
from loraplex.engine.model.moe.routing import ExpertBlocks

__all__ = [
    "EXPERT_LORA_CONFIGS",
    "ExpertLoRAConfig",
    "expert_lora_config",
    "expert_lora_triton",
]


EXPAND_BLOCK_R = 16  # the expand's rank chunk


@dataclass(frozen=True)
class ExpertLoRAConfig:
    block_c: int = 32  # the shrink's column tile (over h's S*R columns)
    block_k: int = 64  # the shrink's K tile (over the input features)
    block_n: int = 64  # the expand's N tile (over one slice's output features)
    num_warps: int = 4
    num_stages: int = 2

    def smem_bytes(self, block_m: int, elem: int = 4) -> int:
        """Shared memory of the larger of the two launches' pipelined tiles (``elem``: 4 bounds
        every dtype): the shrink's x (block_m x K) and A (K x C) tiles, the expand's h and B."""
        shrink = (block_m + self.block_c) * self.block_k
        expand = (block_m + self.block_n) * EXPAND_BLOCK_R
        return max(shrink, expand) * elem * self.num_stages


def _tiles(shape: Mapping[str, int]) -> ExpertLoRAConfig:
    """h's columns (S*R) in one shrink tile up to 64 (rank 32 gate_up), in tiles of 64 past."""
    return ExpertLoRAConfig(block_c=min(64, max(16, triton.next_power_of_2(shape["cols"]))))


# sm_90 rows: benchmarks/moe_configs.py on an H100 (1a49833, CUDA graph replays, Qwen3-30B-A3B
# shapes, 8 rank-16 slots, bf16; BENCHMARKS.md "Mixture of experts"), both at blocks of 16 pairs:
# 1 stream (8 pairs) gate_up / down 19.7 / 11.6 -> 11.8 / 9.3 us against the generic rule;
# 64 streams (512 pairs) 155.7 / 81.7 -> 57.3 / 37.5 us. The switch at 128 pairs (16 streams):
# at 16 / 32 streams the 512-pair tiles are within 1-4 % of the best (518afca, same card); at 8
# streams (64 pairs) wider n tiles than the 1-stream row's: gate_up (S*R = 32 columns) 32.0 ->
# 29.6 us with block_n 128, down (16 columns) 22.4 -> 19.2 us with block_n 256 (rank 16
# measured; those rows hold from 32 pairs, 4 streams, to 127).
# Generic rows: at most 64 KB of shared memory (float32, 64-pair blocks), any rank.
_SM90: tuple[Rule[ExpertLoRAConfig], ...] = (
    Rule(
        ExpertLoRAConfig(block_c=32, block_k=256, block_n=256, num_warps=4, num_stages=3),
        block_m=16,
        pairs=(128, None),
    ),  # fmt: skip
    Rule(
        ExpertLoRAConfig(block_c=16, block_k=256, block_n=128, num_warps=4, num_stages=3),
        block_m=16,
        pairs=(32, 127),
        cols=32,
    ),  # fmt: skip
    Rule(
        ExpertLoRAConfig(block_c=16, block_k=256, block_n=256, num_warps=4, num_stages=3),
        block_m=16,
        pairs=(32, 127),
        cols=16,
    ),  # fmt: skip
    Rule(
        ExpertLoRAConfig(block_c=16, block_k=256, block_n=64, num_warps=4, num_stages=3), block_m=16
    ),  # fmt: skip
    Rule(_tiles),
)
EXPERT_LORA_CONFIGS = LaunchTable("moe_expert_lora", {GENERIC: (Rule(_tiles),), "sm90": _SM90})


def expert_lora_config(
    block_m: int, cols: int, device: torch.device | str | None = None, pairs: int = 0
) -> ExpertLoRAConfig:
    """The launch for blocks of ``block_m`` pairs and ``cols`` = S*R shrunk columns (S slices
    at max rank R), ``pairs`` routed (token, expert) pairs in all, on ``device`` (None: the
    generic rows); ``EXPERT_LORA_CONFIGS``."""
    return EXPERT_LORA_CONFIGS.pick(device, block_m=block_m, cols=cols, pairs=pairs)


@triton.jit(do_not_specialize=["P"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    pairs_ptr,
    experts_ptr,
    slots_ptr,
    ranks_ptr,
    P,
    K,
    L,
    R,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_hm,
    stride_hr,
    A_DIV: tl.constexpr,
    TOP_K: tl.constexpr,
    SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    blk = tl.program_id(0)
    expert = tl.load(experts_ptr + blk)
    if expert < 0:  # past the last used block
        return
    pair = tl.load(pairs_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < P
    slot = tl.load(slots_ptr + pair // TOP_K, mask=live, other=-1)
    slot = tl.where(slot < L, slot, -1)  # a slot past the expert-capable ones: no experts
    row_rank = tl.load(ranks_ptr + slot, mask=slot >= 0, other=0)
    on = live & (slot >= 0) & (row_rank > 0)
    if tl.sum(on.to(tl.int32)) == 0:
        return
    row = (pair // A_DIV).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # h's column c: A's row c
    c_ok = offs_c < SLICES * R
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + row[:, None] * stride_xm
    # slot s's A columns: advanced by a slot each iteration (64-bit pointer arithmetic)
    a_cols = a_ptr + expert.to(tl.int64) * stride_ae + offs_c[None, :] * stride_ar
    acc = tl.full((BLOCK_M, BLOCK_C), 0.0, tl.float32)
    for s in range(0, L):
        rows = on & (slot == s)
        if tl.sum(rows.to(tl.int32)) > 0:
            rank = tl.load(ranks_ptr + s)
            cols = c_ok & ((offs_c % R) < rank)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < K
                xt = tl.load(
                    x_rows + kk[None, :] * stride_xk,
                    mask=rows[:, None] & k_mask[None, :],
                    other=0.0,
                )
                at = tl.load(
                    a_cols + kk[:, None] * stride_ak,
                    mask=k_mask[:, None] & cols[None, :],
                    other=0.0,
                )
                if IEEE:  # float32 weights: no TF32 (the CPU oracle's precision)
                    acc += tl.dot(xt, at.to(xt.dtype), input_precision="ieee")
                else:
                    acc += tl.dot(xt, at.to(xt.dtype))
        a_cols += stride_al
    h = h_ptr + pair.to(tl.int64)[:, None] * stride_hm + offs_c[None, :] * stride_hr
    tl.store(h, acc, mask=on[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["P"])
def _expand_kernel(
    h_ptr,
    b_ptr,
    out_ptr,
    pairs_ptr,
    experts_ptr,
    slots_ptr,
    ranks_ptr,
    P,
    W,
    L,
    R,
    n_tiles,
    stride_hm,
    stride_hr,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_H: tl.constexpr,
):
    blk = tl.program_id(0)
    expert = tl.load(experts_ptr + blk)
    if expert < 0:
        return
    pair = tl.load(pairs_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < P
    slot = tl.load(slots_ptr + pair // TOP_K, mask=live, other=-1)
    slot = tl.where(slot < L, slot, -1)  # a slot past the expert-capable ones: no experts
    row_rank = tl.load(ranks_ptr + slot, mask=slot >= 0, other=0)
    on = live & (slot >= 0) & (row_rank > 0)
    if tl.sum(on.to(tl.int32)) == 0:
        return
    j = tl.program_id(1) // n_tiles  # the slice: output columns j*W .. (j+1)*W, h's j*R ..
    offs_n = (tl.program_id(1) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < W
    col = j * W + offs_n
    h_rows = h_ptr + pair.to(tl.int64)[:, None] * stride_hm + (j * R) * stride_hr
    b_cols = b_ptr + expert.to(tl.int64) * stride_be + col[None, :] * stride_bn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for s in range(0, L):
        rows = on & (slot == s)
        if tl.sum(rows.to(tl.int32)) > 0:
            rank = tl.load(ranks_ptr + s)
            for r0 in range(0, rank, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < rank
                h = tl.load(
                    h_rows + offs_r[None, :] * stride_hr,
                    mask=rows[:, None] & r_mask[None, :],
                    other=0.0,
                )
                b = tl.load(
                    b_cols + offs_r[:, None] * stride_br,
                    mask=r_mask[:, None] & n_mask[None, :],
                    other=0.0,
                )  # (BLOCK_R, BLOCK_N): B^T's tile
                if SPLIT_H:  # h = hi + lo in B's 16-bit dtype: two dots, ~float32-accurate
                    h_hi = h.to(b.dtype)
                    acc += tl.dot(h_hi, b)
                    acc += tl.dot((h - h_hi.to(tl.float32)).to(b.dtype), b)
                else:
                    acc += tl.dot(h, b, input_precision="ieee")
        b_cols += stride_bl
    o = out_ptr + pair.to(tl.int64)[:, None] * stride_om + col[None, :] * stride_on
    o_mask = on[:, None] & n_mask[None, :]
    old = tl.load(o, mask=o_mask, other=0.0)
    tl.store(o, (old.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def expert_lora_triton(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    blocks: ExpertBlocks,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    out: torch.Tensor,
    *,
    a_div: int,
    top_k: int,
    config: ExpertLoRAConfig | None = None,
) -> None:
    """``out`` += the expert LoRA delta (module docstring); shapes checked by the caller
    (``expert_lora.expert_lora_delta``): a (L, E, S*R, K), b (L, E, R, N) (B^T), out (P, N)."""
    p, n = out.shape
    if p == 0:
        return
    num_slots, _, sr, k = a.shape
    r = b.shape[2]
    slices = sr // r
    block_m = blocks.block_m
    cfg = config or expert_lora_config(block_m, sr, x.device, p)
    h = torch.empty(p, sr, dtype=torch.float32, device=x.device)
    _shrink_kernel[(blocks.num_blocks, triton.cdiv(sr, cfg.block_c))](
        x,
        a,
        h,
        blocks.pairs,
        blocks.experts,
        token_slots,
        ranks,
        p,
        k,
        num_slots,
        r,
        x.stride(0),
        x.stride(1),
        *a.stride(),
        h.stride(0),
        h.stride(1),
        A_DIV=a_div,
        TOP_K=top_k,
        SLICES=slices,
        BLOCK_M=block_m,
        BLOCK_C=cfg.block_c,
        BLOCK_K=cfg.block_k,
        IEEE=a.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    width = n // slices
    n_tiles = triton.cdiv(width, cfg.block_n)
    _expand_kernel[(blocks.num_blocks, slices * n_tiles)](
        h,
        b,
        out,
        blocks.pairs,
        blocks.experts,
        token_slots,
        ranks,
        p,
        width,
        num_slots,
        r,
        n_tiles,
        h.stride(0),
        h.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(3),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_R=EXPAND_BLOCK_R,
        SPLIT_H=b.dtype != torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
