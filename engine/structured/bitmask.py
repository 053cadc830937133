"""Token bitmasks of a step: filled on the host from the rows' matchers, applied to the
logits on the device in one launch.

A mask row holds ``ceil(V / 32)`` int32 words; bit ``t % 32`` of word ``t // 32`` set means
token ``t`` is allowed. Only constrained rows have a mask row; ``rows`` maps mask row i to its
logits row. Semantics of ``apply_bitmask``:

    for i in range(R):
        for t in range(V):
            if not (mask[i, t // 32] >> (t % 32)) & 1:
                logits[rows[i], t] = -inf

On CUDA one Triton launch covers every constrained row (grid: rows x vocab tiles); elsewhere
the torch twin ``apply_bitmask_torch`` runs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from loraplex.engine.structured.threads import fill_threads

if TYPE_CHECKING:
    from loraplex.engine.structured.grammars import Guide

__all__ = [
    "apply_bitmask",
    "apply_bitmask_torch",
    "fill_masks",
    "fill_threads",
    "mask_words",
    "warm_bitmask",
]


def mask_words(vocab: int) -> int:
    return (vocab + 31) // 32


@functools.cache
def _executor() -> Any:
    import llguidance

    return llguidance.LLExecutor(fill_threads())


def fill_masks(
    guides: Sequence[Guide], vocab: int, eos_ids: Sequence[int], pin: bool
) -> torch.Tensor:
    """Host (R, W) int32 masks of ``guides`` for their next token (step thread; the matchers
    compute in llguidance's own threads, without the GIL). A matcher that failed allows only
    EOS, so its request ends."""
    words = mask_words(vocab)
    mask = torch.empty((len(guides), words), dtype=torch.int32, pin_memory=pin)
    # NOTE: rows whose matchers share a lexer run one after another (its mutex: grammars.py,
    # "Lanes"); adjacent in the list, they tend to land on one thread instead of blocking two
    ok = sorted(
        ((g.matcher, i) for i, g in enumerate(guides) if not g.failed),
        key=lambda e: guides[e[1]].lexer,
    )
    if ok:
        # NOTE: writes row i at data_ptr + i * words * 4 (mask is contiguous, just allocated)
        _executor().unsafe_compute_mask_ptr(ok, mask.data_ptr(), words * 4, len(guides))
    if len(ok) < len(guides):
        for i, g in enumerate(guides):
            if g.failed:
                mask[i].zero_()
                for t in eos_ids:
                    mask[i, t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)
    return mask


def apply_bitmask_torch(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``logits[rows[i], t] = -inf`` where bit t of ``mask[i]`` is clear."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1  # (R, W, 32)
    allowed = bits.reshape(mask.shape[0], -1)[:, :vocab].bool()
    picked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, picked)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place, see the module docstring. ``logits`` (B, V) float, ``mask`` (R, W) int32 and
    ``rows`` (R,) int64 on its device."""
    if mask.shape[0] == 0:
        return
    if logits.is_cuda:
        from loraplex.engine.structured.triton_bitmask import apply_bitmask_triton

        apply_bitmask_triton(logits, mask, rows)
    else:
        with torch.inference_mode():  # the model's logits are inference tensors
            apply_bitmask_torch(logits, mask, rows)


def warm_bitmask(vocab: int, max_rows: int, device: torch.device) -> None:
    """Start-up (CUDA): compile the kernel and cache pinned host blocks of the largest mask,
    so the first constrained step while serving compiles and allocates nothing."""
    if device.type != "cuda":
        return
    host = torch.full((max_rows, mask_words(vocab)), -1, dtype=torch.int32, pin_memory=True)
    index = torch.arange(max_rows, dtype=torch.long).pin_memory()
    logits = torch.zeros((max_rows, vocab), dtype=torch.float32, device=device)
    apply_bitmask(logits, host.to(device, non_blocking=True), index.to(device, non_blocking=True))
    torch.cuda.synchronize(device)
    del host, index  # (their pinned blocks stay in torch's host cache)
