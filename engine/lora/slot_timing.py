"""Timing of slot writes (benchmarks, the storm's idle-write line): GB/s of ``write_slot``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from loraplex.engine.model.lora.slot_buffers import forget_slot_contents, write_slot

if TYPE_CHECKING:
    from loraplex.engine.model.lora.slot_image import PackedAdapter
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["measure_slot_write"]


def measure_slot_write(
    model: CausalLM,
    packed: PackedAdapter,
    repeats: int = 10,
    *,
    slot: int = 0,
    zero_fill: bool = False,
) -> float:
    """GB/s of ``write_slot`` (H2D bytes of ``packed`` over wall time); overwrites ``slot``.
    Rewrites of one layout skip the zero-fill of the rest; ``zero_fill``: every write does it
    (as a write into a slot that held another layout)."""
    cuda = model.device.type == "cuda"

    def write() -> None:
        if zero_fill:
            forget_slot_contents(model, slot)
        write_slot(model, slot, packed)

    # warm-up: the staging allocation, and the scatter plan of the timed writes (the first
    # write into a slot of another layout zero-fills: a plan of its own)
    write_slot(model, slot, packed)
    write()
    if cuda:
        torch.cuda.synchronize(model.device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        write()
    if cuda:
        torch.cuda.synchronize(model.device)
    return packed.nbytes * repeats / (time.perf_counter() - t0) / 1e9
