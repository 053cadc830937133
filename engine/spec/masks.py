"""Structured-output masks of a verification step: one per position of a constrained row.

Position ``j`` of a row with proposal ``d_1 .. d_k`` samples the token after ``d_1 .. d_j``,
so its mask is the grammar's after those tokens: each matcher takes the proposal one token
at a time, its mask filled at every stop, and is rolled back to where it was (the verified
tokens are accepted after the step, as for any row). The proposal was cut at the first token
its grammar refuses (``Speculation.propose``); a token refused anyway stops the walk, and the
mask of the position before it keeps that token out, so it is never kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from loraplex.engine.structured.bitmask import fill_masks

if TYPE_CHECKING:
    from loraplex.engine.scheduler import ScheduledChunk

__all__ = ["spec_masks"]


def spec_masks(
    chunks: Sequence[ScheduledChunk], vocab: int, pin: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host (R, W) int32 masks of every position of the constrained rows among ``chunks``
    (the step's sampled chunks, in row order) and their positions (R,) in the step's flat
    logits rows (step thread)."""
    rows = []  # (guide, first position, proposal)
    pos = 0
    for c in chunks:
        draft = c.proposal.tokens if c.proposal is not None else []
        if c.req.guide is not None:
            rows.append((c.req.guide, pos, draft, sorted(c.req.eos_ids)))
        pos += 1 + len(draft)
    masks, index = [], []
    consumed = [0] * len(rows)
    live = list(range(len(rows)))
    depth = 0
    while live:
        guides = [rows[i][0] for i in live]
        masks.append(fill_masks(guides, vocab, rows[live[0]][3], pin=False))
        index += [rows[i][1] + depth for i in live]
        nxt = []
        for i in live:
            guide, _, draft, _ = rows[i]
            m = guide.matcher
            if depth >= len(draft) or m.is_stopped() or m.is_error():
                continue
            # (checked first: a refused token would put the matcher in its error state)
            if m.validate_tokens([draft[depth]]) == 1 and m.consume_token(draft[depth]):
                consumed[i] += 1
                nxt.append(i)
        live = nxt
        depth += 1
    for (guide, *_), n in zip(rows, consumed, strict=True):
        if n:
            guide.matcher.rollback(n)
    mask = torch.cat(masks)
    order = torch.tensor(index, dtype=torch.long)
    if pin:
        mask, order = mask.pin_memory(), order.pin_memory()
    return mask, order
