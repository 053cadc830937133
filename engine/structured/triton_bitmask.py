"""Triton twin of ``bitmask.apply_bitmask_torch``: one launch for every constrained row.

Grid: ``(R, cdiv(V, BLOCK))``; program (i, j) reads the mask words of vocab tile j of mask row
i and writes -inf into ``logits[rows[i]]`` where a token's bit is clear. Only Triton builtins
(see ``model/lora/ops/triton_shrink.py`` on the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_bitmask_triton", "BLOCK"]

BLOCK = 4096


@triton.jit
def _apply_bitmask(
    logits_ptr,
    mask_ptr,
    rows_ptr,
    vocab,
    logits_stride,
    mask_stride,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(mask_ptr + i * mask_stride + offs // 32, mask=inside, other=-1)
    clear = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=inside & clear)


def apply_bitmask_triton(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place, as ``apply_bitmask_torch``; ``logits`` rows contiguous (stride 1 in V)."""
    assert logits.stride(1) == 1 and mask.stride(1) == 1, "rows must be contiguous"
    n, vocab = mask.shape[0], logits.shape[1]
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_bitmask[grid](logits, mask, rows, vocab, logits.stride(0), mask.stride(0), BLOCK=BLOCK)
