"""The slot image: an adapter packed into one contiguous (pinned) CPU buffer, laid out for a
one-copy slot write (slot_buffers.py), and its layout key.

Per layer (``VOCAB_LAYER`` = -1 first: the embedding's and the LM head's LoRA), the targeted
modules (in ``MODULE_ORDER``) are laid out as

    [B^T_m0 (r, out) | B^T_m1 (r, out) | ... | A_m0 (r, in) | A_m1 (r, in) | ...]

A fused experts module (model/moe/lora_names.py, ``experts`` = E) keeps the file's A (r*E, in)
and B^T (r*E, out) as they are (r*E rows, PEFT's order); the slot write splits them per expert.

Both keep the adapter's own r rows, whatever R = max_lora_rank the slots have: the slots store
A and B rank-major (model/lora/layers.py), so row j of B^T lands on the slot's contiguous
``lora_b[slot, lo:hi, j]`` and row j of A on ``lora_a[s, slot, j]``; rows r..R are zero-filled on
the device. Padding never costs pinned memory or H2D bytes (a rank-8 adapter in a rank-64
engine moves rank-8 bytes). Modules the adapter does not target are not in the buffer either:
their slot regions are zero-filled (see slot_buffers.py).

The format is the contract of the device write (this process and tensor-parallel workers);
parsing a file into it is the adapter lifecycle's stage step (adapters/staging.py).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.engine.model.config import MODULE_ORDER, ModelConfig
from loraplex.engine.model.lora.weights import LoRAWeights, WeightsView

if TYPE_CHECKING:
    from loraplex.engine.model.lora.weights import HasWeights
    from loraplex.engine.model.protocol import CausalLM

__all__ = [
    "LayoutKey",
    "PackEntry",
    "PackedAdapter",
    "PackedWeights",
    "pack_adapter",
    "model_max_rank",
    "slot_image_numel",
    "full_layout",
    "layout_of",
    "new_buffer",
]

_ALIGN = 64  # elements: block offsets stay 128-256 B aligned (vectorised copies)
_ORDER = MODULE_ORDER


@dataclass(frozen=True)
class PackEntry:
    """One targeted module: where its blocks lie in ``PackedAdapter.buffer`` (in elements)."""

    layer: int
    module: str
    rank: int  # r: rows of A
    in_features: int
    out_features: int
    a_offset: int  # A: (r, in)
    b_offset: int  # B^T: (r, out)
    experts: int = 1  # a fused experts module's E: A (r*E, in), B^T (r*E, out); rank is r

    @property
    def rows(self) -> int:
        """Rows of the A and B^T blocks."""
        return self.rank * self.experts


class LayoutKey:
    """A packed layout as a key: hashed once, one object per distinct layout (``intern``),
    so that the slot writes' lookups and comparisons are an identity check, not a walk over
    every module's entry (~30 µs per hash or comparison at the 8B shape's 224 modules)."""

    __slots__ = ("value", "_hash", "__weakref__")

    def __init__(self, value: tuple) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, LayoutKey) and self._hash == other._hash and self.value == other.value
        )

    @staticmethod
    def intern(value: tuple) -> LayoutKey:
        with _LAYOUTS_LOCK:
            key = _LAYOUTS.get(value)
            if key is None:
                key = _LAYOUTS[value] = LayoutKey(value)
            return key


_LAYOUTS: weakref.WeakValueDictionary[tuple, LayoutKey] = weakref.WeakValueDictionary()
_LAYOUTS_LOCK = threading.Lock()  # packed adapters are made in loader threads


@dataclass(frozen=True)
class PackedAdapter:
    buffer: torch.Tensor  # (numel,) flat, one dtype; pinned when it feeds a CUDA slot
    entries: dict[tuple[int, str], PackEntry]  # (layer, module) -> blocks
    max_rank: int  # R of the slots it is for (must equal the model's max_lora_rank)

    @property
    def nbytes(self) -> int:
        """Bytes one slot write moves host -> device."""
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @functools.cached_property
    def layout(self) -> LayoutKey:
        """Equal (the same object) for packed images with the same blocks at the same offsets
        (slot writes cache their scatter plan and their zero state per layout)."""
        return LayoutKey.intern((self.max_rank, tuple(self.entries.values())))

    def a(self, e: PackEntry) -> torch.Tensor:
        """View of e's A block, (r, in) (fused experts: (r*E, in))."""
        return self.buffer[e.a_offset : e.a_offset + e.rows * e.in_features].view(
            e.rows, e.in_features
        )

    def b(self, e: PackEntry) -> torch.Tensor:
        """View of e's B, (out, r) (the transpose of its (r, out) block; fused experts: r*E)."""
        n = e.out_features * e.rows
        return self.buffer[e.b_offset : e.b_offset + n].view(e.rows, e.out_features).t()


def model_max_rank(model: CausalLM) -> int:
    """R of the model's LoRA slots."""
    for _, linears in model.lora_linears():
        for linear in linears.values():
            return linear.max_rank
    raise ValueError("the model has no LoRA layers")


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def layout_of(
    shapes: dict[tuple[int, str], tuple[int, ...]], max_rank: int
) -> tuple[dict[tuple[int, str], PackEntry], int]:
    """Offsets of every (layer, module) -> (r, in, out[, experts]) block, and the buffer's
    numel (a fused experts module's blocks have r * experts rows)."""
    keys = sorted(shapes, key=lambda k: (k[0], _ORDER[k[1]]))
    entries: dict[tuple[int, str], PackEntry] = {}
    off = 0
    for layer in sorted({k[0] for k in keys}):
        mods = [k for k in keys if k[0] == layer]
        b_offs = {}
        for k in mods:  # B blocks first, back to back
            b_offs[k] = off
            off += shapes[k][2] * shapes[k][0] * _experts(shapes[k])
        off = _align(off)
        for k in mods:
            r, d_in, d_out = shapes[k][:3]
            n = _experts(shapes[k])
            entries[k] = PackEntry(layer, k[1], r, d_in, d_out, off, b_offs[k], n)
            off = _align(off + r * n * d_in)
    return entries, off


def _experts(dims: tuple[int, ...]) -> int:
    return dims[3] if len(dims) > 3 else 1


def full_layout(
    model_config: ModelConfig, max_rank: int
) -> tuple[dict[tuple[int, str], PackEntry], int]:
    """Layout of the largest packed adapter: every module of every layer (the embedding and
    the LM head included, a MoE model's experts in their larger, per-expert layout) at rank R."""
    shapes: dict[tuple[int, str], tuple[int, ...]] = {
        key: (max_rank, d_in, d_out)
        for key, (d_in, d_out) in model_config.adapter_module_shapes().items()
    }
    for key, (d_in, d_out) in model_config.expert_module_shapes().items():
        shapes[key] = (max_rank, d_in, d_out)
    return layout_of(shapes, max_rank)


def slot_image_numel(model_config: ModelConfig, max_rank: int) -> int:
    """Elements of the largest packed adapter (what a host-pool region must hold)."""
    return full_layout(model_config, max_rank)[1]


@torch.no_grad()
def pack_adapter(
    adapter: HasWeights,
    model: CausalLM | int,
    *,
    pin: bool = False,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> PackedAdapter:
    """Lay out ``adapter`` for a slot of R = ``model``'s max_lora_rank (or ``model`` if an int).

    CPU work only (call it from a worker thread); ``dtype`` defaults to the adapter's (or
    ``out``'s). ``out``: a flat 1-D buffer to pack into (a host-pool region) instead of a new
    allocation; the packed buffer is its prefix.
    """
    max_rank = model if isinstance(model, int) else model_max_rank(model)
    shapes = {}
    for k, w in adapter.weights.items():
        rows, d_in = w.a.shape
        r = rows // w.experts
        if r > max_rank or w.b.shape[1] != rows or r * w.experts != rows:
            raise ValueError(
                f"{k}: A {tuple(w.a.shape)} / B {tuple(w.b.shape)} do not fit rank {max_rank}"
            )
        shapes[k] = (r, d_in, w.b.shape[0], w.experts)
    entries, numel = layout_of(shapes, max_rank)
    if dtype is None:
        first = next(iter(adapter.weights.values()), None)
        fallback = first.a.dtype if first is not None else torch.float32
        dtype = out.dtype if out is not None else fallback
    packed = PackedAdapter(new_buffer(numel, dtype, pin, out), entries, max_rank)
    # NOTE: alignment gaps are never read
    for k, e in entries.items():
        w = adapter.weights[k]
        packed.a(e).copy_(w.a)
        packed.b(e).copy_(w.b)
    return packed


def new_buffer(numel: int, dtype: torch.dtype, pin: bool, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    if out.dim() != 1 or out.numel() < numel or out.dtype != dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} cannot hold {numel} elements")
    return out[:numel]


class PackedWeights(WeightsView):
    """An adapter's weights as views of its packed buffer, made on first access: a slot write
    never reads them, and making ~450 views per adapter when it is staged held the engine's
    GIL a fifth of the time during load storms."""

    def __init__(self, packed: PackedAdapter) -> None:
        self.packed = packed
        self._made: dict[tuple[int, str], LoRAWeights] = {}
        entries = packed.entries.values()
        self.rank = max((e.rank for e in entries), default=0)
        elem = packed.buffer.element_size()
        self.nbytes = sum(e.rows * (e.in_features + e.out_features) for e in entries) * elem

    def __getitem__(self, key: tuple[int, str]) -> LoRAWeights:
        w = self._made.get(key)
        if w is None:
            e = self.packed.entries[key]  # KeyError for a module the adapter does not target
            w = LoRAWeights(a=self.packed.a(e), b=self.packed.b(e), experts=e.experts)
            self._made[key] = w
        return w

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(self.packed.entries)

    def __len__(self) -> int:
        return len(self.packed.entries)
