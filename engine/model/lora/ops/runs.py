"""LoRA delta over runs of consecutive rows: the CPU fast path of ``add_lora``.

When the rows of each adapter slot are consecutive (``LoRAMapping.runs``), the torch path
needs no gather or scatter: per run, one batched shrink over all slices of the fused layer and
one in-place ``addmm_`` per slice, on row slices of ``x`` and ``y``. Its twin is
``shrink_torch`` + ``expand_torch`` (tests/model/lora/ops/test_runs.py compares them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["add_lora_runs"]


def add_lora_runs(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: Sequence[int],
    runs: Sequence[tuple[int, int, int, int]],
) -> None:
    """``y[rows, slice s] += (x[rows] @ lora_a[s, slot, :rank].T) @ lora_b[slot, slice s, :rank].T``.

    x: (T, in); y: (T, N_total) float32, in place; lora_a: (S, L, R, in); lora_b: (L, N_total, R)
    with the scale folded in; ``runs``: (slot, first row, length, rank). Semantics::

        for slot, start, n, rank in runs:
            for t in range(start, start + n):
                for s in range(S):
                    lo, hi = slice_offsets[s], slice_offsets[s + 1]
                    y[t, lo:hi] += (x[t] @ lora_a[s, slot, :rank].T) @ lora_b[slot, lo:hi, :rank].T

    Same fp32 math as the reference (its ``.float()`` casts are no-ops here); float32 only.
    """
    if y.dtype != torch.float32:
        raise ValueError(f"add_lora_runs works in float32, got y {y.dtype}")
    num_slices = len(slice_offsets) - 1
    for slot, start, n, rank in runs:
        if n == 0 or rank == 0:
            continue
        whole = start == 0 and n == y.shape[0]
        xs = x if whole else x[start : start + n]  # (n, in)
        ys = y if whole else y[start : start + n]  # (n, N_total)
        b = lora_b[slot, :, :rank]  # (N_total, rank)
        if num_slices == 1:
            h = torch.mm(xs, lora_a[0, slot, :rank].t())  # (n, rank)
            ys.addmm_(h, b.t())
            continue
        h = torch.matmul(xs, lora_a[:, slot, :rank].transpose(1, 2))  # (S, n, rank)
        for s in range(num_slices):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            ys[:, lo:hi].addmm_(h[s], b[lo:hi].t())
