"""The LM head of full-table slots (modules_to_save, model/lora/full.py), by token slots::

    for t in range(T):
        f = slot[t]
        if 0 <= f < F and on[f]:
            y[t] = h[t] @ table[f].T        # replaces the base logits of row t

``table`` (F, V, H), ``on`` (F,) int32: slot f holds a table. Accumulated in float32, stored in
``y``'s dtype (the logits are float32). Rows of other slots, of slot -1 (base) and of slots
without a table keep ``y``. The Triton kernel (``triton_full_head.py``) depends on T alone (CUDA
graphs) and reads only the tables of slots some row uses; the torch twin reads the slots on the
host (tests, CPU).
"""

from __future__ import annotations

import torch

__all__ = ["full_head", "full_head_torch"]


def full_head(
    y: torch.Tensor,
    h: torch.Tensor,
    table: torch.Tensor,
    on: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    triton: bool,
) -> None:
    F, V, H = table.shape
    T = y.shape[0]
    if tuple(y.shape) != (T, V) or tuple(h.shape) != (T, H):
        raise ValueError(f"y {tuple(y.shape)} / h {tuple(h.shape)}: want ({T}, {V}) / ({T}, {H})")
    if tuple(token_slots.shape) != (T,) or tuple(on.shape) != (F,):
        raise ValueError(f"token_slots {tuple(token_slots.shape)} / on {tuple(on.shape)}")
    if triton:
        from loraplex.engine.model.lora.ops.triton_full_head import full_head_triton

        full_head_triton(y, h, table, on, token_slots)
    else:
        full_head_torch(y, h, table, on, token_slots)


def full_head_torch(
    y: torch.Tensor,
    h: torch.Tensor,
    table: torch.Tensor,
    on: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """The twin: one GEMM per full slot present (reads the slots on the host)."""
    num = table.shape[0]
    flags = on.tolist()
    slots = token_slots.long()
    for f in sorted(set(slots.tolist())):
        if not 0 <= f < num or not flags[f]:
            continue
        rows = (slots == f).nonzero().squeeze(1)
        logits = h.index_select(0, rows).float() @ table[f].float().t()  # (n, V)
        y.index_copy_(0, rows, logits.to(y.dtype))
