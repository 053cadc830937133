"""Triton: the embedding / LM head LoRA expand (``ops/vocab.py`` states its meaning).

Grid ``(cdiv(T, BLOCK_T), cdiv(N, BLOCK_N))``: a program owns a tile of ``y``; a block of base
rows (every slot -1, or a slot ``on`` does not flag) returns after its slot and flag loads, so
those rows cost a launch and nothing else.
Rows of a block sharing a slot share its B tile (``lora_delta``, tensor-core dots). Nothing but
``T`` shapes the launch: it is captured in the decode CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.engine.model.lora.ops.delta import block_r, lora_delta

__all__ = ["lora_vocab_expand_triton"]

BLOCK_T = 16
BLOCK_N = 128


# NOTE: T not specialised (== 1, divisible by 16): eager steps of any row count share one
# compiled variant, warmed at start-up (warmup.py)
@triton.jit(do_not_specialize=["T"])
def _vocab_expand_kernel(
    y_ptr,
    h_ptr,
    b_ptr,
    slots_ptr,
    on_ptr,
    T,
    N,
    L,
    R,
    stride_yt,
    stride_yn,
    stride_ht,
    stride_hn,
    stride_bl,
    stride_bn,
    stride_br,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < T
    slots = tl.load(slots_ptr + tok, mask=t_mask, other=-1).to(tl.int32)
    live = slots >= 0
    on = tl.load(on_ptr + tl.where(live, slots, 0), mask=live, other=0)
    slots = tl.where(on != 0, slots, -1)  # (a slot without this module: its B is zero)
    if tl.reduce(slots, 0, tl.standard._elementwise_max) >= 0:
        # NOTE: a new name, not ``tok`` re-typed: compiled Triton refuses a variable whose type
        # changes inside an if (the interpreter accepts it)
        rows = tok.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        c_mask = cols < N
        acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
        acc = lora_delta(
            acc, h_ptr, b_ptr, rows, slots, cols, c_mask, 0, R, 1, L, R,  # slot-major shrink
            stride_ht, stride_hn, stride_bl, stride_bn, stride_br, BLOCK_R, True,
        )  # fmt: skip
        ptrs = y_ptr + rows[:, None] * stride_yt + cols[None, :] * stride_yn
        mask = t_mask[:, None] & c_mask[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_vocab_expand_triton(
    y: torch.Tensor,
    shrink: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    on: torch.Tensor,
) -> None:
    t = y.shape[0]
    if t == 0:
        return
    num_slots, n, rank = lora_b.shape
    grid = (triton.cdiv(t, BLOCK_T), triton.cdiv(n, BLOCK_N))
    _vocab_expand_kernel[grid](
        y, shrink, lora_b, token_slots, on, t, n, num_slots, rank,
        y.stride(0), y.stride(1), shrink.stride(0), shrink.stride(1), *lora_b.stride(),
        BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, BLOCK_R=block_r(rank, True),
    )  # fmt: skip
