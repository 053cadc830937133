"""Torch reference of the grouped LoRA ops: the CPU path, and the oracle for the Triton kernels.

Vectorized per segment (one gather, one matmul per slice); no per-token Python loop. Reads the
segment table to the host once per call (a device sync when the mapping lives on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.engine.model.lora.mapping import LoRAMapping

__all__ = ["shrink_torch", "expand_torch", "segments_host"]


def segments_host(mapping: LoRAMapping) -> list[tuple[int, int, int, int]]:
    """``(slot, start, length, rank)`` of every segment, as host ints."""
    if not mapping.has_lora:
        return []
    return list(
        zip(
            mapping.seg_slots.tolist(),
            mapping.seg_starts.tolist(),
            mapping.seg_lens.tolist(),
            mapping.seg_ranks.tolist(),
            strict=True,
        )
    )


def shrink_torch(
    x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor
) -> None:
    """``out[s, t, :rank] = x[t] @ lora_a[s, slot, :rank].T`` for every LoRA token (fp32).

    x: (T, in); lora_a: (S, L, R, in); out: (S, T, R) float32. Semantics::

        for g in segments: slot = seg_slots[g]; rank = seg_ranks[g]
            for t in sorted_token_ids[seg_starts[g] : seg_starts[g] + seg_lens[g]]:
                for s in range(S):
                    out[s, t, :rank] = x[t] @ lora_a[s, slot, :rank].T   # fp32 accumulate

    Columns >= rank and rows of base tokens (slot -1) are left as they are.
    """
    ids = mapping.sorted_token_ids.to(torch.long)
    for slot, start, n, rank in segments_host(mapping):
        if n == 0 or rank == 0:
            continue
        idx = ids[start : start + n]  # (n,)
        xs = x.index_select(0, idx).float()  # (n, in)
        a = lora_a[:, slot, :rank].float()  # (S, rank, in)
        out[:, idx, :rank] = torch.matmul(xs, a.transpose(1, 2))  # (S, n, rank)


def expand_torch(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: Sequence[int],
    mapping: LoRAMapping,
) -> None:
    """``y[t, slice s] += shrunk[s, t, :rank] @ lora_b[slot, slice s, :rank].T``, in place.

    y: (T, N_total); shrunk: (S, T, R) float32; lora_b: (L, N_total, R), slice ``s`` owns rows
    ``slice_offsets[s] : slice_offsets[s + 1]``. Semantics::

        for g in segments: slot = seg_slots[g]; rank = seg_ranks[g]
            for t in tokens of g:
                for s in range(S):
                    lo, hi = slice_offsets[s], slice_offsets[s + 1]
                    y[t, lo:hi] += shrunk[s, t, :rank] @ lora_b[slot, lo:hi, :rank].T
                    # fp32 math, one rounding into y's dtype

    Base tokens (slot -1) are untouched.
    """
    num_slices = len(slice_offsets) - 1
    ids = mapping.sorted_token_ids.to(torch.long)
    for slot, start, n, rank in segments_host(mapping):
        if n == 0 or rank == 0:
            continue
        idx = ids[start : start + n]  # (n,)
        rows = y.index_select(0, idx).float()  # (n, N_total)
        h = shrunk.index_select(1, idx)[:, :, :rank]  # (S, n, rank)
        for s in range(num_slices):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            b = lora_b[slot, lo:hi, :rank].float()  # (hi - lo, rank)
            rows[:, lo:hi].addmm_(h[s], b.t())
        y.index_copy_(0, idx, rows.to(y.dtype))
