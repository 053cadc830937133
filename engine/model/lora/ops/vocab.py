"""The expand of the embedding / LM head LoRA (model/lora/vocab.py), by token slots::

    for t in range(T):
        if slot[t] >= 0 and on[slot[t]]:
            y[t] += shrink[t, slot[t]*R : (slot[t]+1)*R] @ lora_b[slot[t]].T

``shrink`` (T, L*R) holds every slot's shrink of each row; only the row's own slot is read.
``on`` (L,) int32 flags the slots whose adapter has this module (their B is zero otherwise, so
the skip changes no bit): rows of other slots cost what base rows cost, no B tile and no
read-modify-write of their logits (33 MB of float32 logits for 64 rows of a 128k vocabulary).
Accumulated in float32, added to ``y`` in its dtype (the logits are float32). The Triton kernel
(``triton_vocab.py``) depends on T alone (CUDA graphs) and does no work for blocks of base rows;
the torch twin groups rows by slot on the host (tests, CPU).
"""

from __future__ import annotations

import torch

__all__ = ["lora_vocab_expand", "lora_vocab_expand_torch"]


def lora_vocab_expand(
    y: torch.Tensor,
    shrink: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    on: torch.Tensor,
    *,
    triton: bool,
) -> None:
    L, N, R = lora_b.shape
    T = y.shape[0]
    if y.dim() != 2 or y.shape[1] != N:
        raise ValueError(f"y {tuple(y.shape)}, want (T, {N})")
    if tuple(shrink.shape) != (T, L * R) or tuple(token_slots.shape) != (T,):
        raise ValueError(
            f"shrink {tuple(shrink.shape)} / token_slots: want ({T}, {L * R}) / ({T},)"
        )
    if tuple(on.shape) != (L,) or on.dtype != torch.int32:
        raise ValueError(f"on {tuple(on.shape)} {on.dtype}, want ({L},) int32")
    if triton:
        from loraplex.engine.model.lora.ops.triton_vocab import lora_vocab_expand_triton

        lora_vocab_expand_triton(y, shrink, lora_b, token_slots, on)
    else:
        lora_vocab_expand_torch(y, shrink, lora_b, token_slots, on)


def lora_vocab_expand_torch(
    y: torch.Tensor,
    shrink: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    on: torch.Tensor,
) -> None:
    """The twin: one GEMM per flagged slot present (reads the slots on the host)."""
    R = lora_b.shape[2]
    slots = token_slots.long()
    flagged = set(on.nonzero().flatten().tolist())
    for slot in sorted(set(slots.tolist()) & flagged):
        rows = (slots == slot).nonzero().squeeze(1)
        h = shrink.index_select(0, rows)[:, slot * R : (slot + 1) * R].float()
        delta = h @ lora_b[slot].float().t()  # (n, N)
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))
