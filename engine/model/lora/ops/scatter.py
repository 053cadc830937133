"""A slot write's on-device half in one launch: copy the packed image's blocks into a slot's
regions of every LoRA layer and zero the regions the adapter does not fill.

``slots.write_slot`` first moves the packed image host -> device into a staging tensor; the
scatter then puts ~450 blocks (A per module, runs of B per fused layer) where they belong.
With ``torch._foreach_copy_`` / ``_foreach_zero_`` that meant building ~450 views and their
lists on the host for every write, under the GIL, next to the step thread (~14 % of the GIL's
time during load storms): here the plan is made once per packed layout, as a device table, and
a write is one kernel launch with the slot index as an argument.

The plan's offsets count in elements from the LoRA buffer with the lowest address (``base``);
every LoRA buffer of a model has one dtype. A destination of slot ``s`` is
``base + dst0 + s * slot_stride``. Rows with ``src < 0`` are zero-filled. The torch reference
twin is the ``_foreach`` path in slot_buffers.py (``write_slot(..., scatter="torch")``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["ScatterPlan", "build_plan", "scatter_triton", "BLOCK"]

BLOCK = 8192  # elements per program (16 KB of bf16)


@dataclass(frozen=True)
class ScatterPlan:
    table: torch.Tensor  # (nblocks, 4) int64 on the device: dst0, slot_stride, src (-1: zero), n
    base: torch.Tensor  # the destination buffer every dst0 counts from
    nblocks: int


def build_plan(
    copies: Sequence[tuple[torch.Tensor, int, int]],
    zeros: Sequence[tuple[torch.Tensor, int]],
    base: torch.Tensor,
) -> ScatterPlan:
    """``copies``: (destination view in slot 0, its slot stride, source offset);
    ``zeros``: (destination view in slot 0, its slot stride). Views must lie in buffers of
    ``base``'s dtype and device (any of the model's LoRA buffers), contiguous or 2-D with
    contiguous rows (rank-major A rows, layers.py: one block per row, the source dense).

    Rows of the table: per view, per row of it, per BLOCK-wide piece of the row, in that
    order. A Python loop over the ~6 000 rows of an 8B-shape layout took 6-9 ms under the GIL
    (on the slot-writer thread, beside the step thread, when a layout is first written); the
    views' few numbers are read in Python and the rows expanded with numpy."""
    elem = base.element_size()
    start = base.data_ptr()
    specs: list[tuple[int, int, int, int, int, int]] = []

    def add(view: torch.Tensor, stride: int, src: int) -> None:
        if view.dtype != base.dtype or view.device != base.device:
            raise ValueError("a scatter destination must be of the base's dtype and device")
        if view.is_contiguous():
            n_rows, cols, row_stride = 1, view.numel(), 0
        elif view.dim() == 2 and view.stride(1) == 1:  # rank-major rows (layers.py)
            n_rows, cols, row_stride = view.shape[0], view.shape[1], view.stride(0)
        else:
            raise ValueError("a scatter destination must be contiguous or have contiguous rows")
        delta = view.data_ptr() - start
        if delta < 0 or delta % elem:
            raise ValueError("a scatter destination lies below the base buffer or off its grid")
        specs.append((delta // elem, n_rows, cols, row_stride, stride, src))

    for view, stride, src in copies:
        add(view, stride, src)
    for view, stride in zeros:
        add(view, stride, -1)
    table = torch.from_numpy(_expand(specs)).to(base.device)
    return ScatterPlan(table, base, table.shape[0])


def _expand(specs: list[tuple[int, int, int, int, int, int]]) -> np.ndarray:
    """(nblocks, 4) int64 rows (dst0, slot stride, src or -1, n) of the views ``specs``
    (first element, rows, columns, row stride, slot stride, source offset or -1)."""
    if not specs:
        return np.zeros((0, 4), dtype=np.int64)
    first, n_rows, cols, row_stride, slot_stride, src = np.array(specs, dtype=np.int64).T
    view = np.repeat(np.arange(len(specs)), n_rows)  # a row per row of each view
    i = np.arange(len(view)) - np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
    r_dst = first[view] + i * row_stride[view]
    r_cols = cols[view]
    r_src = np.where(src[view] >= 0, src[view] + i * r_cols, -1)
    pieces = (r_cols + BLOCK - 1) // BLOCK  # BLOCK-wide pieces per row (0 for an empty view)
    row = np.repeat(np.arange(len(r_dst)), pieces)
    lo = (np.arange(len(row)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * BLOCK
    out = np.empty((len(row), 4), dtype=np.int64)
    out[:, 0] = r_dst[row] + lo
    out[:, 1] = slot_stride[view][row]
    out[:, 2] = np.where(r_src[row] >= 0, r_src[row] + lo, -1)
    out[:, 3] = np.minimum(BLOCK, r_cols[row] - lo)
    return out


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # NOTE: slot is not specialised: Triton would compile a variant for slot 1 (and per
    # divisibility by 16) on first use while serving
    @triton.jit(do_not_specialize=["slot"])
    def scatter_kernel(src_ptr, base_ptr, table_ptr, slot, BLOCK: tl.constexpr):
        row = table_ptr + tl.program_id(0) * 4
        dst0 = tl.load(row)
        stride = tl.load(row + 1)
        src = tl.load(row + 2)
        n = tl.load(row + 3)
        offs = tl.arange(0, BLOCK)
        n_read = n * (src >= 0).to(tl.int64)  # zero-fill rows read nothing
        vals = tl.load(src_ptr + src + offs, mask=offs < n_read, other=0.0)
        tl.store(base_ptr + dst0 + slot * stride + offs, vals, mask=offs < n)

    return scatter_kernel


def scatter_triton(src: torch.Tensor, plan: ScatterPlan, slot: int) -> None:
    """Run ``plan`` for ``slot`` from the staged image ``src`` on the current stream."""
    if plan.nblocks == 0:
        return
    if src.dtype != plan.base.dtype:
        raise ValueError(f"staged image is {src.dtype}, the slots are {plan.base.dtype}")
    _kernel()[(plan.nblocks,)](src, plan.base, plan.table, slot, BLOCK=BLOCK, num_warps=4)
