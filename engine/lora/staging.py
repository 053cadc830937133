"""The stage step's packing: an adapter's tensors, or its file, into one slot image
(model/lora/slot_image.py), with the adapter's weights re-pointed at views of the image.

``stage_packed`` (a combination, made from its components' tensors) packs an adapter that is
already in memory; ``stage_file`` writes each module straight from the file into the image
(the parser's checks, one pass per tensor); ``adopt_packed`` points an adapter at an image a
loader process packed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from loraplex.engine.lora.adapter import ModuleDims, PairSink, load_adapter
from loraplex.engine.lora.tensor_checks import fold_scale_into
from loraplex.engine.lora.thread_jobs import StageStopped
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.lora.slot_image import (
    PackedAdapter,
    PackedWeights,
    attach_packed,
    layout_of,
    new_buffer,
    pack_adapter,
)

if TYPE_CHECKING:
    from loraplex.engine.lora.adapter import LoRAAdapter

__all__ = ["stage_packed", "stage_file", "adopt_packed"]


@torch.no_grad()
def stage_packed(
    adapter: LoRAAdapter, max_rank: int, *, pin: bool, out: torch.Tensor | None = None
) -> PackedAdapter:
    """Pack (pinned if ``pin``), point ``adapter.weights`` at views of the packed buffer (one
    copy of the data in host memory: the tensors' values are unchanged, B becomes the (out, r)
    transposed view of its (r, out) block) and attach the packed form to the adapter."""
    packed = pack_adapter(adapter, max_rank, pin=pin, out=out)
    adopt_packed(adapter, packed)
    return packed


@torch.no_grad()
def stage_file(
    path: str,
    model_config: ModelConfig,
    max_rank: int,
    *,
    dtype: torch.dtype,
    name: str | None = None,
    full_modules: bool = False,
    read_full: bool = True,
    pin: bool = False,
    out: torch.Tensor | None = None,
    stop: threading.Event | None = None,
) -> LoRAAdapter:
    """``stage_packed(load_adapter(path, ...))`` without the adapter's own tensors: every
    check of ``load_adapter``, then each module's A and scaled B written straight from the
    file's bytes into the slot image (one pass per tensor, the same values bit for bit).
    ``stop``: checked before each module is written; set, the stage raises StageStopped."""
    made: list[PackedAdapter] = []

    def sink_for(dims: ModuleDims) -> PairSink:
        entries, numel = layout_of(dims, max_rank)
        made.append(PackedAdapter(new_buffer(numel, dtype, pin, out), entries, max_rank))
        packed = made[0]

        def put(key: tuple[int, str], a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
            if stop is not None and stop.is_set():
                raise StageStopped(f"staging {name or path!r} stopped: its load was cancelled")
            e = entries[key]
            packed.a(e).copy_(a)
            fold_scale_into(packed.b(e), b, scale)

        return put

    adapter = load_adapter(
        path, model_config, max_lora_rank=max_rank, name=name, dtype=dtype,
        full_modules=full_modules, read_full=read_full, sink_for=sink_for,
    )  # fmt: skip
    adopt_packed(adapter, made[0])
    return adapter


def adopt_packed(adapter: LoRAAdapter, packed: PackedAdapter) -> None:
    """Point ``adapter.weights`` at views of ``packed`` (made on access) and attach it (see
    ``stage_packed``)."""
    adapter.weights = PackedWeights(packed)
    attach_packed(adapter, packed)
