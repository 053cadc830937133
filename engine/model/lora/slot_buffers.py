"""The device half of a slot write: an adapter's tensors written into (or cleared from) one
GPU slot of every LoRA layer of a model (and of its full-table slots, model/lora/full.py, if
it has them). ``SlotBuffers`` is one model's: the slot views, the device staging tensor and the
scatter plans, caches only; what a slot holds is the caller's to know (the adapters' slot
store), passed in as decisions.

A write is one host -> device copy of the adapter's packed buffer (slot_image.py) into a device
staging tensor, then one scatter into the slot's regions and, with ``zero_rest``, a zero-fill
of the rest (one Triton launch on CUDA, ops/scatter.py; batched ``_foreach`` copies as its
twin): a few launches instead of ~4 per module per layer. The caller passes ``zero_rest``
False where the slot is known to hold zeros there already (it was cleared, or last written with
the same layout) and ``had_dora`` False where its DoRA scales are known to be ones. Everything
is issued on the current stream (the slot writer picks a side stream for cold loads); writes
issued in order on one stream never race on the staging tensor, which is reused per (dtype,
stream).

The module functions ``write_slot`` / ``clear_slot`` / ``write_slot_reference`` are direct
writes (tests, benchmarks, the cold-load study) with the safe decisions; they count as
per-module writes (``generation``), so that a slot store's knowledge of the slots is voided.

One concept, ~490 lines (with MoE expert regions): the plan of a slot's regions, its cached
scatter and the copy paths are one write, read together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.engine.model.config import MODULE_ORDER, VOCAB_LAYER
from loraplex.engine.model.lora.ops.scatter import ScatterPlan, build_plan, scatter_triton
from loraplex.engine.model.lora.slot_image import LayoutKey, PackedAdapter, pack_adapter
from loraplex.engine.model.lora.vocab import mark_vocab_slot
from loraplex.engine.model.moe.expert_writes import (
    ExpertPlan,
    expert_plan,
    write_experts_batched,
    write_experts_per_module,
)
from loraplex.engine.model.moe.lora_names import expert_module

if TYPE_CHECKING:
    from loraplex.engine.model.lora.layers import LoRALinear
    from loraplex.engine.model.lora.vocab import VocabLoRA
    from loraplex.engine.model.lora.weights import SlotSource
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["SlotBuffers", "write_slot", "clear_slot", "write_slot_reference"]

_ORDER = MODULE_ORDER
_STAGING_GRAIN = 1 << 20  # elements: staging grows in steps of this


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
class _Sites:
    sites: list[_Site]  # layer-major, MODULE_ORDER: one linear's slices are consecutive
    linears: list[LoRALinear | VocabLoRA]
    signature: tuple[int, ...]  # storage pointers the cached views were made from
    views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=dict
    )  # slot -> (lora_a[s, slot] (R, in), lora_b[slot, lo:hi]^T (R, out)) per site
    # NOTE: rank-major storage (layers.py): each rank row of a view is contiguous
    staging: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)
    plans: dict[tuple, ScatterPlan] = field(default_factory=dict)  # (layout, zeros) -> plan
    expert_plans: dict[LayoutKey, ExpertPlan] = field(default_factory=dict)  # layout -> plan


def _signature(linears: list[LoRALinear | VocabLoRA]) -> tuple[int, ...]:
    out = []
    for lin in linears:
        assert lin.lora_a is not None and lin.lora_b is not None, "the model has no LoRA slots"
        out += (lin.lora_a.data_ptr(), lin.lora_b.data_ptr())
    return tuple(out)


def _sites(model: CausalLM, c: _Sites | None) -> _Sites:
    """The model's sites and cached slot views: ``c``, or new ones if a layer's LoRA buffers
    were replaced (the layers themselves are assumed to stay)."""
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
    return _Sites(sites, linears, _signature(linears))


def _slot_views(c: _Sites, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per site: ``lora_a[s, slot]`` (R, in) and ``lora_b[slot, lo:hi]`` transposed (R, out);
    rank-major storage (layers.py): each row contiguous, rows strided."""
    if slot not in c.views:
        a = [x.linear.lora_a[x.s, slot] for x in c.sites]  # type: ignore[index]
        b = [x.linear.lora_b[slot, x.lo : x.hi].t() for x in c.sites]  # type: ignore[index]
        c.views[slot] = (a, b)
    return c.views[slot]


def _check_slot(slot: int, c: _Sites) -> None:
    num = c.sites[0].linear.max_loras if c.sites else 0
    if not 0 <= slot < num:
        raise IndexError(f"slot {slot} out of range [0, {num})")


def _plan(
    c: _Sites, slot: int, packed: PackedAdapter, strides: list[int] | None = None
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
    if found != sum(1 for k in packed.entries if expert_module(k[1]) is None):
        raise ValueError("the packed adapter targets modules this model does not have")
    if strides is not None:
        strides += dst_strides + zero_strides
    return dst, src, zero


def _scatter_plan(c: _Sites, packed: PackedAdapter, zeros: bool = True) -> ScatterPlan:
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
    c: _Sites,
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


def _write_full(model: CausalLM, slot: int, adapter: object) -> None:
    """``slot``'s full tables (modules_to_save, model/lora/full.py): the adapter's, none
    elsewhere. Nothing happens on a model without full-table slots (an adapter with tables is
    refused)."""
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


def _write_dora(c: _Sites, slot: int, adapter: object, had_dora: bool) -> None:
    """``slot``'s DoRA row scales (model/lora/dora.py): the adapter's g per module, ones
    elsewhere. Nothing is written while neither the slot (``had_dora``) nor the adapter has
    any (plain LoRA)."""
    scales = getattr(adapter, "dora", None)
    if not scales and not had_dora:
        return
    linears = [lin for lin in c.linears if lin.dora_scale is not None]
    for lin in linears:
        lin.dora_scale[slot].fill_(1.0)  # type: ignore[index]
        lin.dora_on[slot].zero_()  # type: ignore[union-attr]
    if not scales:
        return
    for site in c.sites:
        g = scales.get((site.layer, site.module))
        if g is not None:
            dst = site.linear.dora_scale[slot, site.lo : site.hi]  # type: ignore[index]
            dst.copy_(g.to(dst.dtype), non_blocking=True)
            site.linear.dora_on[slot].fill_(1)  # type: ignore[union-attr]


def _expert_plan(c: _Sites, model: CausalLM, packed: PackedAdapter) -> ExpertPlan:
    """The one-launch expert scatter of ``packed``'s layout (model/moe/expert_writes.py), made
    once per layout."""
    plan = c.expert_plans.get(packed.layout)
    if plan is None:
        plan = expert_plan(dict(getattr(model, "expert_loras", list)()), packed)
        if len(c.expert_plans) >= 64:
            c.expert_plans.pop(next(iter(c.expert_plans)))
        c.expert_plans[packed.layout] = plan
    return plan


def _write_experts(
    c: _Sites,
    model: CausalLM,
    slot: int,
    packed: PackedAdapter,
    base: torch.Tensor | None,
    scatter: str,
) -> None:
    """``slot``'s expert LoRA (model/moe/expert_lora.py): cleared where it may hold an
    earlier adapter's, then the adapter's expert modules from ``base`` (the packed buffer on
    the device): ``scatter`` "triton": one launch (model/moe/expert_writes.py), "torch": per
    module (``ExpertLoRA.set``, its twin). A model without experts takes none (an adapter with
    some was refused)."""
    blocks = dict(getattr(model, "expert_loras", list)())
    if scatter == "triton" and blocks:
        write_experts_batched(blocks, slot, _expert_plan(c, model, packed), base)
    else:
        write_experts_per_module(blocks, slot, packed, base)


def _has_experts(packed: PackedAdapter) -> bool:
    return any(expert_module(k[1]) is not None for k in packed.entries)


def packed_of(source: SlotSource | PackedAdapter, max_rank: int, **pack: object) -> PackedAdapter:
    """The slot image a write of ``source`` copies: itself, the adapter's attached image
    (``image``, slot_image.py), or the adapter packed now (``pack``: ``pack_adapter``'s
    keywords)."""
    if isinstance(source, PackedAdapter):
        if source.max_rank != max_rank:
            raise ValueError(
                f"packed for rank {source.max_rank}, the model's slots have {max_rank}"
            )
        return source
    image = getattr(source, "image", None)
    if image is not None and image.max_rank == max_rank:
        return image
    return pack_adapter(source, max_rank, **pack)  # type: ignore[arg-type]


class SlotBuffers:
    """One model's slot writes (see the module docstring): caches, no record of what a slot
    holds. Thread-safe only in the sense of the streams: one writer at a time per stream."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self._c: _Sites | None = None

    def _sites(self) -> _Sites:
        self._c = _sites(self.model, self._c)
        return self._c

    def generation(self) -> int:
        """Per-module writes into the slots so far (``set_lora`` / ``reset_lora``, direct
        writes): a record of what a slot holds is void once this changes."""
        return sum(getattr(lin, "slot_writes", 0) for lin in self._sites().linears)

    def bump(self) -> None:
        """Count a write nobody records (a direct write): voids every record of the slots."""
        c = self._sites()
        if c.linears:
            c.linears[0].slot_writes += 1

    def prepare_plans(self, packed: PackedAdapter) -> None:
        """Make ``packed``'s layout's scatter plans now, with and without the zero-fill
        (start-up: the first write of a layout, and its first rewrite, then build none on the
        slot writer)."""
        c = self._sites()
        if c.sites:
            for zeros in (True, False):
                _scatter_plan(c, packed, zeros)
            if _has_experts(packed):
                _expert_plan(c, self.model, packed)

    @torch.no_grad()
    def write(
        self,
        slot: int,
        source: SlotSource | PackedAdapter,
        *,
        zero_rest: bool = True,
        had_dora: bool = True,
        h2d_done: torch.cuda.Event | None = None,
        chunk_bytes: int | None = None,
        pace: Callable[[torch.cuda.Event], None] | None = None,
        scatter: str = "auto",
    ) -> None:
        """Copy every module of ``source`` into ``slot``; modules it does not target are
        zeroed, their regions only with ``zero_rest`` (False: the caller knows they hold
        zeros, see the module docstring). ``had_dora`` False: the slot's DoRA scales are ones.

        An adapter (``SlotSource``) is written from its attached image (``image``) or packed
        now. ``h2d_done``: recorded on the current stream right after the host -> device copy
        (before the on-device scatter), to time the transfer alone. ``chunk_bytes`` / ``pace``:
        move the image in pieces, each after ``pace`` saw the previous one land (see
        adapters/slot_writer.py). ``scatter``: "triton" (one launch, ops/scatter.py), "torch"
        (batched ``_foreach`` copies, the reference twin) or "auto" (Triton on CUDA).
        """
        c = self._sites()
        _check_slot(slot, c)
        if not c.sites:
            return
        model = self.model
        lin0 = c.sites[0].linear
        r_max, dtype, device = lin0.max_rank, lin0.lora_b.dtype, lin0.lora_b.device
        packed = packed_of(source, r_max, pin=device.type == "cuda", dtype=dtype)
        if scatter == "auto":
            scatter = "triton" if device.type == "cuda" else "torch"
        if scatter not in ("triton", "torch"):
            raise ValueError(f"scatter must be 'auto', 'triton' or 'torch', not {scatter!r}")
        # NOTE: a slot refilled with the layout it held (same modules and ranks: the common
        # case when the CPU tier's adapters come from one recipe) skips the zero-fill of the
        # rest, most of the device writes of an attention-only adapter (~52 of ~80 MB at the
        # 8B shape)
        src = None
        if scatter == "triton":
            plan = _scatter_plan(c, packed, zero_rest)
            src = _source(c, packed, device, dtype, chunk_bytes, pace) if packed.entries else None
            if h2d_done is not None:
                h2d_done.record()
            scatter_triton(src if src is not None else plan.base, plan, slot)
        else:
            dst, ranges, zero = _plan(c, slot, packed)
            if dst or _has_experts(packed):
                base = src = _source(c, packed, device, dtype, chunk_bytes, pace)
                if h2d_done is not None:
                    h2d_done.record()
                views = [
                    base[o : o + n].view(d.shape) for d, (o, n) in zip(dst, ranges, strict=True)
                ]
                if dst:
                    _copy(dst, views)
            if zero and zero_rest:
                _zero(zero)
        _write_experts(c, model, slot, packed, src, scatter)
        layers = {m for la, m in packed.entries if la == VOCAB_LAYER}
        mark_vocab_slot(model.lora_vocab(), slot, layers)
        _write_dora(c, slot, source, had_dora)
        _write_full(model, slot, source)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """Zero ``slot`` of every LoRA layer (batched), its DoRA scales back to ones, no full
        tables."""
        c = self._sites()
        _check_slot(slot, c)
        a_views, b_views = _slot_views(c, slot)
        if a_views:
            _zero(a_views + b_views)
        for _, block in getattr(self.model, "expert_loras", list)():
            block.dirty.add(slot)  # unknown: zero it
            block.clear(slot)
        mark_vocab_slot(self.model.lora_vocab(), slot, set())
        _write_dora(c, slot, None, True)
        _write_full(self.model, slot, None)

    @torch.no_grad()
    def write_reference(self, slot: int, source: SlotSource) -> None:
        """The per-module write (~4 launches per module and layer): the oracle of the tests."""
        model = self.model
        for layer_idx, linears in [(VOCAB_LAYER, model.lora_vocab()), *model.lora_linears()]:
            for module, linear in linears.items():
                w = source.weights.get((layer_idx, module))
                if w is None:
                    linear.reset_lora(slot, module)
                else:
                    linear.set_lora(slot, module, w.a, w.b)
        blocks = dict(getattr(model, "expert_loras", list)())
        for block in blocks.values():
            block.dirty.add(slot)
            block.clear(slot)
        for (layer_idx, module), w in source.weights.items():
            em = expert_module(module)
            if em is not None:
                blocks[layer_idx].set(slot, em.role, em.expert, w.a, w.b)
        _write_dora(self._sites(), slot, source, True)
        _write_full(model, slot, source)


# -- direct writes (tests, benchmarks, the cold-load study): the safe decisions ----------------


def write_slot(
    model: CausalLM, slot: int, source: SlotSource | PackedAdapter, **kw: object
) -> None:
    """``SlotBuffers(model).write(slot, source, **kw)``, zero-fill and DoRA reset unless told
    otherwise; voids what a slot store knows of the model's slots (``generation``)."""
    buffers = SlotBuffers(model)
    buffers.write(slot, source, **kw)  # type: ignore[arg-type]
    buffers.bump()


def clear_slot(model: CausalLM, slot: int) -> None:
    """``SlotBuffers(model).clear(slot)``."""
    buffers = SlotBuffers(model)
    buffers.clear(slot)
    buffers.bump()


def write_slot_reference(model: CausalLM, slot: int, source: SlotSource) -> None:
    """``SlotBuffers(model).write_reference(slot, source)`` (bumps ``generation`` itself)."""
    SlotBuffers(model).write_reference(slot, source)
