"""Write an adapter's tensors into (or clear) one GPU slot of every LoRA layer of a model
(and of its full-table slots, model/lora/full.py, if it has them).

A write is one host -> device copy of the adapter's packed buffer (slot_image.py) into a device
staging tensor, then one scatter into the slot's regions and a zero-fill of the rest (one
Triton launch on CUDA, scatter.py; batched ``_foreach`` copies as its twin): a few launches
instead of ~4 per module per layer. The zero-fill is skipped where the slot is known to hold
zeros already (``_ModelCache.zero_state``: it was cleared, or last written with the same
layout). Everything is issued on the current stream (callers pick a side stream for
cold loads); writes issued in order on one stream never race on the staging tensor, which is
reused per (model, dtype, stream).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.engine.model.config import MODULE_ORDER, VOCAB_LAYER
from loraplex.engine.model.lora.ops.scatter import ScatterPlan, build_plan, scatter_triton
from loraplex.engine.model.lora.slot_image import LayoutKey, PackedAdapter, pack_adapter, packed_for
from loraplex.engine.model.lora.vocab import mark_vocab_slot

if TYPE_CHECKING:
    from loraplex.engine.model.lora.layers import LoRALinear
    from loraplex.engine.model.lora.vocab import VocabLoRA
    from loraplex.engine.model.lora.weights import SlotSource
    from loraplex.engine.model.protocol import CausalLM

__all__ = [
    "write_slot",
    "clear_slot",
    "write_slot_reference",
    "forget_slot_contents",
    "prepare_scatter_plans",
]

_ORDER = MODULE_ORDER
_STAGING_GRAIN = 1 << 20  # elements: staging grows in steps of this
_CLEAR = "clear"  # zero_state: the whole slot is zero


@dataclass(frozen=True)
class _Site:
    """One module's slice of a fused LoRALinear."""

    layer: int
    module: str
    linear: LoRALinear | VocabLoRA
    s: int  # slice index
    lo: int  # rows lo:hi of lora_b[slot]
    hi: int


@dataclass
class _ModelCache:
    sites: list[_Site]  # layer-major, MODULE_ORDER: one linear's slices are consecutive
    linears: list[LoRALinear | VocabLoRA]
    signature: tuple[int, ...]  # storage pointers the cached views were made from
    views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict
    )  # slot -> (lora_a[s, slot] (R, in), lora_b[slot, lo:hi]^T (R, out)) per site
    # NOTE: rank-major storage (layers.py): each rank row of a view is contiguous
    staging: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)
    plans: dict[tuple, ScatterPlan] = field(default_factory=dict)  # (layout, zeros) -> plan
    dora_slots: set[int] = field(default_factory=set)  # slots whose DoRA scales are not ones
    # slot -> (what its regions outside that are known to hold: zeros, generation): a packed
    # layout (the last write's: everything it did not fill is zero) or _CLEAR (all zero);
    # generation = the linears' per-module writes then (set_lora / reset_lora void it)
    zero_state: dict[int, tuple[object, int]] = field(default_factory=dict)


_CACHES: weakref.WeakKeyDictionary[CausalLM, _ModelCache] = weakref.WeakKeyDictionary()


def _signature(linears: list[LoRALinear | VocabLoRA]) -> tuple[int, ...]:
    out = []
    for lin in linears:
        assert lin.lora_a is not None and lin.lora_b is not None, "the model has no LoRA slots"
        out += (lin.lora_a.data_ptr(), lin.lora_b.data_ptr())
    return tuple(out)


def _cache(model: CausalLM) -> _ModelCache:
    """The model's sites and cached slot views (rebuilt if a layer's LoRA buffers were replaced;
    the layers themselves are assumed to stay)."""
    c = _CACHES.get(model)
    if c is not None and _signature(c.linears) == c.signature:
        return c
    sites, linears = [], []
    vocab = model.lora_vocab()
    for layer, by_module in [(VOCAB_LAYER, vocab), *model.lora_linears()]:
        linears += dict.fromkeys(by_module.values())
        for module in sorted(by_module, key=_ORDER.__getitem__):
            lin = by_module[module]
            s = lin.slice_index(module)
            sites.append(
                _Site(layer, module, lin, s, lin.slice_offsets[s], lin.slice_offsets[s + 1])
            )
    c = _CACHES[model] = _ModelCache(sites, linears, _signature(linears))
    return c


def _slot_views(c: _ModelCache, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per site: ``lora_a[s, slot]`` (R, in) and ``lora_b[slot, lo:hi]`` transposed (R, out);
    rank-major storage (layers.py): each row contiguous, rows strided."""
    if slot not in c.views:
        a = [x.linear.lora_a[x.s, slot] for x in c.sites]  # type: ignore[index]
        b = [x.linear.lora_b[slot, x.lo : x.hi].t() for x in c.sites]  # type: ignore[index]
        c.views[slot] = (a, b)
    return c.views[slot]


def _check_slot(slot: int, c: _ModelCache) -> None:
    num = c.sites[0].linear.max_loras if c.sites else 0
    if not 0 <= slot < num:
        raise IndexError(f"slot {slot} out of range [0, {num})")


def _plan(
    c: _ModelCache, slot: int, packed: PackedAdapter, strides: list[int] | None = None
) -> tuple[list[torch.Tensor], list[tuple[int, int]], list[torch.Tensor]]:
    """(destination views, (offset, numel) of each source in the buffer, views to zero).
    ``strides``: if given, gets each destination's then each zero view's slot stride.

    Each targeted module copies its own r rows of A (r, in) and of B^T (r, out) and zeroes
    rows r..R; an untargeted one zeroes all R."""
    a_views, b_views = _slot_views(c, slot)
    dst: list[torch.Tensor] = []
    src: list[tuple[int, int]] = []
    zero: list[torch.Tensor] = []
    dst_strides: list[int] = []
    zero_strides: list[int] = []
    found = 0
    for i, site in enumerate(c.sites):
        e = packed.entries.get((site.layer, site.module))
        lin = site.linear
        a_slot, b_slot = lin.lora_a.stride(1), lin.lora_b.stride(0)  # type: ignore[union-attr]
        pairs = (
            (a_views[i], a_slot, e and e.a_offset, lin.in_features),
            (b_views[i], b_slot, e and e.b_offset, site.hi - site.lo),
        )
        if e is not None:
            found += 1
            if e.in_features != lin.in_features or e.out_features != site.hi - site.lo:
                raise ValueError(f"packed {site.module} of layer {site.layer} has other shapes")
            if e.rank > packed.max_rank:
                raise ValueError(f"packed {site.module} of layer {site.layer}: rank {e.rank}")
        rank = e.rank if e is not None else 0
        for view, stride, off, width in pairs:
            if rank:
                dst.append(view[:rank])  # (r, width): only the adapter's own rank rows
                dst_strides.append(stride)
                src.append((off, rank * width))  # type: ignore[arg-type]
            if rank < view.shape[0]:
                zero.append(view[rank:])
                zero_strides.append(stride)
    if found != len(packed.entries):
        raise ValueError("the packed adapter targets modules this model does not have")
    if strides is not None:
        strides += dst_strides + zero_strides
    return dst, src, zero


def _scatter_plan(c: _ModelCache, packed: PackedAdapter, zeros: bool = True) -> ScatterPlan:
    """The one-launch scatter of ``packed``'s layout (made once per layout, see scatter.py);
    ``zeros`` False: without the zero-fill of the regions the layout does not fill."""
    key = (packed.layout, zeros)
    plan = c.plans.get(key)
    if plan is None:
        strides: list[int] = []
        dst, ranges, zero = _plan(c, 0, packed, strides)
        bufs = [t for lin in c.linears for t in (lin.lora_a, lin.lora_b) if t is not None]
        base = min(bufs, key=lambda t: t.data_ptr())
        copies = [
            (d, st, o) for d, st, (o, _) in zip(dst, strides[: len(dst)], ranges, strict=True)
        ]
        fills = list(zip(zero, strides[len(dst) :], strict=True)) if zeros else []
        if len(c.plans) >= 64:  # layouts seen: a handful (ranks x module sets) in practice
            c.plans.pop(next(iter(c.plans)))
        plan = c.plans[key] = build_plan(copies, fills, base)
    return plan


def forget_slot_contents(model: CausalLM, slot: int) -> None:
    """Forget what ``slot`` is known to hold: its next write zero-fills what its layout does
    not fill (as a write into a slot that held another layout)."""
    _cache(model).zero_state.pop(slot, None)


def prepare_scatter_plans(model: CausalLM, packed: PackedAdapter) -> None:
    """Make ``packed``'s layout's scatter plans now, with and without the zero-fill (start-up:
    the first write of a layout, and its first rewrite, then build none on the slot writer)."""
    c = _cache(model)
    if c.sites:
        for zeros in (True, False):
            _scatter_plan(c, packed, zeros)


def _generation(c: _ModelCache) -> int:
    return sum(getattr(lin, "slot_writes", 0) for lin in c.linears)


def _zeros_known(c: _ModelCache, slot: int, layout: LayoutKey) -> bool:
    """Everything ``layout`` does not fill is already zero in ``slot``: the slot was cleared,
    or its last write had this layout, and no per-module write touched the slots since."""
    state = c.zero_state.get(slot)
    return (
        state is not None
        and (state[0] is _CLEAR or state[0] == layout)
        and state[1] == _generation(c)
    )


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src)
    else:  # pragma: no cover - torch < 2.1
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def _zero(ts: list[torch.Tensor]) -> None:
    if hasattr(torch, "_foreach_zero_"):
        torch._foreach_zero_(ts)
    else:  # pragma: no cover
        for t in ts:
            t.zero_()


def _source(
    c: _ModelCache,
    packed: PackedAdapter,
    device: torch.device,
    dtype: torch.dtype,
    chunk_bytes: int | None = None,
    pace: Callable[[torch.cuda.Event], None] | None = None,
) -> torch.Tensor:
    """The packed buffer on ``device`` in ``dtype``: one (async, if pinned) H2D copy, or
    ``chunk_bytes`` pieces each issued after ``pace(event of the previous one)`` returns."""
    buf = packed.buffer
    if buf.device == device:
        return buf if buf.dtype == dtype else buf.to(dtype)
    numel = buf.numel()
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (dtype, stream)
    staging = c.staging.get(key)
    if staging is None or staging.numel() < numel:
        size = -(-numel // _STAGING_GRAIN) * _STAGING_GRAIN
        staging = c.staging[key] = torch.empty(size, dtype=dtype, device=device)
    out = staging[:numel]
    if chunk_bytes is None or pace is None or device.type != "cuda" or buf.dtype != dtype:
        out.copy_(buf, non_blocking=True)
        return out
    step = max(1, chunk_bytes // buf.element_size())
    for lo in range(0, numel, step):
        out[lo : lo + step].copy_(buf[lo : lo + step], non_blocking=True)
        if lo + step < numel:
            landed = torch.cuda.Event()
            landed.record()
            pace(landed)
    return out


@torch.no_grad()
def write_slot(
    model: CausalLM,
    slot: int,
    adapter: SlotSource | PackedAdapter,
    *,
    h2d_done: torch.cuda.Event | None = None,
    chunk_bytes: int | None = None,
    pace: Callable[[torch.cuda.Event], None] | None = None,
    scatter: str = "auto",
) -> None:
    """Copy every module of ``adapter`` into ``slot``; modules it does not target are zeroed.

    An adapter (``SlotSource``) uses its attached packed form (slot_image.py ``attach_packed``)
    or is packed now.
    ``h2d_done``: recorded on the current stream right after the host -> device copy (before
    the on-device scatter), to time the transfer alone. ``chunk_bytes`` / ``pace``: move the
    image in pieces, each after ``pace`` saw the previous one land (see slot_writer.py).
    ``scatter``: "triton" (one launch, scatter.py), "torch" (batched ``_foreach`` copies, the
    reference twin) or "auto" (Triton on CUDA).
    """
    c = _cache(model)
    _check_slot(slot, c)
    if not c.sites:
        return
    lin0 = c.sites[0].linear
    r_max, dtype, device = lin0.max_rank, lin0.lora_b.dtype, lin0.lora_b.device
    if isinstance(adapter, PackedAdapter):
        packed = adapter
        if packed.max_rank != r_max:
            raise ValueError(f"packed for rank {packed.max_rank}, the model's slots have {r_max}")
    else:
        packed = packed_for(adapter)  # type: ignore[assignment]
        if packed is None or packed.max_rank != r_max:
            packed = pack_adapter(adapter, r_max, pin=device.type == "cuda", dtype=dtype)
    if scatter == "auto":
        scatter = "triton" if device.type == "cuda" else "torch"
    if scatter not in ("triton", "torch"):
        raise ValueError(f"scatter must be 'auto', 'triton' or 'torch', not {scatter!r}")
    # NOTE: a slot refilled with the layout it held (same modules and ranks: the common case
    # when the CPU tier's adapters come from one recipe) skips the zero-fill of the rest, most
    # of the device writes of an attention-only adapter (~52 of ~80 MB at the 8B shape)
    zeros = not _zeros_known(c, slot, packed.layout)
    c.zero_state.pop(slot, None)  # until this write is issued, the slot's state is unknown
    if scatter == "triton":
        plan = _scatter_plan(c, packed, zeros)
        src = _source(c, packed, device, dtype, chunk_bytes, pace) if packed.entries else None
        if h2d_done is not None:
            h2d_done.record()
        scatter_triton(src if src is not None else plan.base, plan, slot)
    else:
        dst, ranges, zero = _plan(c, slot, packed)
        if dst:
            base = _source(c, packed, device, dtype, chunk_bytes, pace)
            if h2d_done is not None:
                h2d_done.record()
            views = [base[o : o + n].view(d.shape) for d, (o, n) in zip(dst, ranges, strict=True)]
            _copy(dst, views)
        if zero and zeros:
            _zero(zero)
    c.zero_state[slot] = (packed.layout, _generation(c))
    mark_vocab_slot(model.lora_vocab(), slot, {m for la, m in packed.entries if la == VOCAB_LAYER})
    _write_dora(c, slot, adapter)
    _write_full(model, slot, adapter)


def _write_full(model: CausalLM, slot: int, adapter: object) -> None:
    """``slot``'s full tables (modules_to_save, model/lora/full.py): the adapter's, none elsewhere.
    Nothing happens on a model without full-table slots (an adapter with tables is refused)."""
    tables = getattr(adapter, "full", None) or {}
    fm = getattr(model, "full_modules", None)
    if fm is None or slot >= fm.num:
        if tables:
            raise ValueError(
                f"slot {slot} has no full-table storage for the adapter's {', '.join(tables)} "
                f"({0 if fm is None else fm.num} full-table slots)"
            )
        return
    fm.write(slot, tables)


def _write_dora(c: _ModelCache, slot: int, adapter: object) -> None:
    """``slot``'s DoRA row scales (model/lora/dora.py): the adapter's g per module, ones elsewhere.
    Nothing is written while neither the slot nor the adapter has any (plain LoRA)."""
    scales = getattr(adapter, "dora", None)
    if not scales and slot not in c.dora_slots:
        return
    linears = [lin for lin in c.linears if lin.dora_scale is not None]
    for lin in linears:
        lin.dora_scale[slot].fill_(1.0)  # type: ignore[index]
        lin.dora_on[slot].zero_()  # type: ignore[union-attr]
    c.dora_slots.discard(slot)
    if not scales:
        return
    for site in c.sites:
        g = scales.get((site.layer, site.module))
        if g is not None:
            dst = site.linear.dora_scale[slot, site.lo : site.hi]  # type: ignore[index]
            dst.copy_(g.to(dst.dtype), non_blocking=True)
            site.linear.dora_on[slot].fill_(1)  # type: ignore[union-attr]
    c.dora_slots.add(slot)


@torch.no_grad()
def clear_slot(model: CausalLM, slot: int) -> None:
    """Zero ``slot`` of every LoRA layer (batched)."""
    c = _cache(model)
    _check_slot(slot, c)
    a_views, b_views = _slot_views(c, slot)
    if a_views:
        _zero(a_views + b_views)
    c.zero_state[slot] = (_CLEAR, _generation(c))
    mark_vocab_slot(model.lora_vocab(), slot, set())
    _write_dora(c, slot, None)
    _write_full(model, slot, None)


@torch.no_grad()
def write_slot_reference(model: CausalLM, slot: int, adapter: SlotSource) -> None:
    """The per-module write (~4 launches per module and layer): the oracle of the tests."""
    for layer_idx, linears in [(VOCAB_LAYER, model.lora_vocab()), *model.lora_linears()]:
        for module, linear in linears.items():
            w = adapter.weights.get((layer_idx, module))
            if w is None:
                linear.reset_lora(slot, module)
            else:
                linear.set_lora(slot, module, w.a, w.b)
    _write_dora(_cache(model), slot, adapter)
    _write_full(model, slot, adapter)
