"""Triton: the LM head of full-table slots (``ops/full_head.py`` states its meaning).

Grid ``(F, cdiv(V, BLOCK_N))``: program (f, n) owns columns n of full slot f. A slot without a
table returns after one load; otherwise the program walks the rows in blocks of ``BLOCK_T`` and
computes only blocks holding a row of slot f (rows are grouped by slot in every step, so a
used slot's (BLOCK_N, H) tile is read about once per step; slots no row uses are not read).
Nothing but ``T`` shapes the launch: it is captured in the CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["full_head_triton"]

BLOCK_T = 16
BLOCK_N = 64
BLOCK_K = 64


# NOTE: T not specialised: eager steps of any row count share one compiled variant
@triton.jit(do_not_specialize=["T"])
def _full_head_kernel(
    y_ptr,
    h_ptr,
    w_ptr,
    on_ptr,
    slots_ptr,
    T,
    V,
    H,
    stride_yt,
    stride_yv,
    stride_ht,
    stride_hk,
    stride_wf,
    stride_wv,
    stride_wk,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    f = tl.program_id(0)
    if tl.load(on_ptr + f) != 0:
        w_base = w_ptr + f.to(tl.int64) * stride_wf
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = cols < V
        offs_k = tl.arange(0, BLOCK_K)
        for t0 in range(0, T, BLOCK_T):
            tok = t0 + tl.arange(0, BLOCK_T)
            slots = tl.load(slots_ptr + tok, mask=tok < T, other=-1).to(tl.int32)
            hit = slots == f
            if tl.reduce(hit.to(tl.int32), 0, tl.standard._elementwise_max) > 0:
                rows = tok.to(tl.int64)
                acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + offs_k
                    k_mask = k < H
                    a = tl.load(
                        h_ptr + rows[:, None] * stride_ht + k[None, :] * stride_hk,
                        mask=hit[:, None] & k_mask[None, :],
                        other=0.0,
                    )  # (BLOCK_T, BLOCK_K)
                    w = tl.load(
                        w_base + cols[None, :] * stride_wv + k[:, None] * stride_wk,
                        mask=k_mask[:, None] & c_mask[None, :],
                        other=0.0,
                    )  # (BLOCK_K, BLOCK_N)
                    acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
                ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yv
                tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=hit[:, None] & c_mask[None, :])


def full_head_triton(
    y: torch.Tensor,
    h: torch.Tensor,
    table: torch.Tensor,
    on: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    t = y.shape[0]
    if t == 0:
        return
    num, v, hidden = table.shape
    grid = (num, triton.cdiv(v, BLOCK_N))
    _full_head_kernel[grid](
        y, h, table, on, token_slots, t, v, hidden,
        y.stride(0), y.stride(1), h.stride(0), h.stride(1), *table.stride(),
        BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
