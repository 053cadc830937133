"""Grouped (SGMV-style) LoRA ops: one launch covers every adapter and slice of the batch.

Public entry points dispatch per call on the step's ``LoRAMapping.triton`` (the kernel backend
chose it, ``model/backend.py``): the Triton kernels (on CPU they run through the interpreter
when ``TRITON_INTERPRET=1`` is set before the first Triton call), else the torch reference.
Every entry point takes the step's ``LoRAMapping``, built with its segments
(``LoRAMapping.build``).

Triton is imported lazily, so this package imports without it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.lora.ops.reference import expand_torch, shrink_torch

__all__ = [
    "lora_shrink",
    "lora_expand",
    "add_lora",
    "shrink_torch",
    "expand_torch",
    "shrink_triton",
    "expand_triton",
]


@functools.cache
def _kernels() -> tuple[ModuleType, ModuleType]:
    from loraplex.engine.model.lora.ops import triton_expand, triton_shrink

    return triton_shrink, triton_expand


def shrink_triton(
    x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor, **kw: Any
) -> None:
    """Triton shrink (imports Triton on first use). ``kw``: ``config``, ``fp32_precision``."""
    _kernels()[0].shrink_triton(x, lora_a, mapping, out, **kw)


def expand_triton(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: Sequence[int],
    mapping: LoRAMapping,
    **kw: Any,
) -> None:
    """Triton expand (imports Triton on first use). ``kw``: ``config``, ``fp32_precision``."""
    _kernels()[1].expand_triton(y, shrunk, lora_b, slice_offsets, mapping, **kw)


def _check_mapping(mapping: LoRAMapping) -> None:
    if not mapping.has_segments:
        raise ValueError("the grouped ops need a LoRAMapping with segments (LoRAMapping.build)")


def _check_shrink(x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor) -> None:
    if x.dim() != 2 or lora_a.dim() != 4 or out.dim() != 3:
        raise ValueError(
            f"x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, out {tuple(out.shape)}"
        )
    s, _, r, k = lora_a.shape
    if x.shape[1] != k or tuple(out.shape) != (s, x.shape[0], r):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, lora_a (S, L, R, in)={tuple(lora_a.shape)}, "
            f"out {tuple(out.shape)} (want ({s}, {x.shape[0]}, {r}))"
        )
    if out.dtype != torch.float32:
        raise ValueError(f"out must be float32, got {out.dtype}")


def _check_expand(
    y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, slice_offsets: Sequence[int]
) -> None:
    if y.dim() != 2 or shrunk.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(
            f"y {tuple(y.shape)}, shrunk {tuple(shrunk.shape)}, lora_b {tuple(lora_b.shape)}"
        )
    s = len(slice_offsets) - 1
    if s < 1 or slice_offsets[0] != 0 or slice_offsets[-1] != y.shape[1]:
        raise ValueError(f"slice_offsets {tuple(slice_offsets)} must run from 0 to {y.shape[1]}")
    if any(a > b for a, b in zip(slice_offsets, slice_offsets[1:], strict=False)):
        raise ValueError(f"slice_offsets {tuple(slice_offsets)} must not decrease")
    if shrunk.shape[0] != s or shrunk.shape[1] != y.shape[0] or shrunk.shape[2] != lora_b.shape[2]:
        raise ValueError(
            f"shrunk {tuple(shrunk.shape)} does not match (S={s}, T={y.shape[0]}, R={lora_b.shape[2]})"
        )
    if lora_b.shape[1] != y.shape[1]:
        raise ValueError(f"lora_b {tuple(lora_b.shape)} has N != y.shape[1]={y.shape[1]}")


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping, out: torch.Tensor
) -> None:
    """``out[s, t, :rank] = x[t] @ lora_a[s, slot(t), :rank].T`` (fp32) for each LoRA token.

    x: (T, in); lora_a: (S, L, R, in); out: (S, T, R) float32. Loop form::

        for g in segments: slot = seg_slots[g]; rank = seg_ranks[g]
            for t in sorted_token_ids[seg_starts[g] : seg_starts[g] + seg_lens[g]]:
                for s in range(S): out[s, t, :rank] = x[t] @ lora_a[s, slot, :rank].T

    Columns >= rank and rows of base tokens (slot -1) are unspecified afterwards.
    """
    _check_mapping(mapping)
    _check_shrink(x, lora_a, out)
    if mapping.triton:
        shrink_triton(x, lora_a, mapping, out)
    else:
        shrink_torch(x, lora_a, mapping, out)


def lora_expand(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: Sequence[int],
    mapping: LoRAMapping,
) -> None:
    """``y[t, lo_s:hi_s] += shrunk[s, t, :rank] @ lora_b[slot(t), lo_s:hi_s, :rank].T``, in place.

    y: (T, N_total); shrunk: (S, T, R) float32; lora_b: (L, N_total, R) with the scale folded in;
    ``slice_offsets`` (S + 1 ints, 0 .. N_total). Loop form::

        for g in segments: slot = seg_slots[g]; rank = seg_ranks[g]
            for t in tokens of g:
                for s in range(S):
                    lo, hi = slice_offsets[s], slice_offsets[s + 1]
                    y[t, lo:hi] += shrunk[s, t, :rank] @ lora_b[slot, lo:hi, :rank].T

    fp32 math, one rounding into y's dtype; base tokens (slot -1) are untouched.
    """
    _check_mapping(mapping)
    _check_expand(y, shrunk, lora_b, slice_offsets)
    if mapping.triton:
        expand_triton(y, shrunk, lora_b, slice_offsets, mapping)
    else:
        expand_torch(y, shrunk, lora_b, slice_offsets, mapping)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slice_offsets: Sequence[int],
    mapping: LoRAMapping,
    buffer: torch.Tensor | None = None,
) -> None:
    """``lora_shrink`` then ``lora_expand``: adds every LoRA token's delta into ``y`` in place.

    ``buffer``: optional float32 scratch of shape (>= S, >= T, >= R); a (S, T, R) view of it is
    used as the shrink output. Allocated when not given. No-op when no token uses an adapter.
    """
    _check_mapping(mapping)
    if not mapping.has_lora:
        return
    s, _, r, _ = lora_a.shape
    t = x.shape[0]
    if buffer is None:
        buffer = torch.empty((s, t, r), dtype=torch.float32, device=x.device)
    else:
        if buffer.dim() != 3 or buffer.shape[0] < s or buffer.shape[1] < t or buffer.shape[2] < r:
            raise ValueError(f"buffer {tuple(buffer.shape)} is smaller than ({s}, {t}, {r})")
        buffer = buffer[:s, :t, :r]
    lora_shrink(x, lora_a, mapping, buffer)
    lora_expand(y, buffer, lora_b, slice_offsets, mapping)
