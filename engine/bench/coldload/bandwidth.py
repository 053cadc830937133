"""Host->device bandwidth references measured in the same run (CUDA only; None on CPU), and
the timing of slot writes.

- ``pinned_gbps``: one 256 MiB pinned->device copy on a side stream (best of a few), the
  ceiling a slot write can reach.
- ``write_slot_gbps``: the engine's own ``write_slot`` of a resident adapter into its own
  slot (same bytes, so nothing changes), timed with CUDA events on a side stream: the copy
  path alone, without the step it waits for or the loop noticing it finished.
- ``measure_slot_write``: GB/s of ``write_slot`` over wall time (benchmarks, the storm's
  idle-write line).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from loraplex.engine.model.lora.slot_buffers import SlotBuffers

if TYPE_CHECKING:
    from loraplex.engine.model.lora.slot_image import PackedAdapter
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["pinned_gbps", "write_slot_gbps", "measure_slot_write"]


PINNED_BYTES = 256 << 20


def _timed(fn: Any, stream: torch.cuda.Stream, repeats: int) -> float:
    """Best seconds of ``fn()`` issued on ``stream`` (after one untimed run)."""
    best = float("inf")
    with torch.cuda.stream(stream):
        fn()
        for _ in range(repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            fn()
            e1.record(stream)
            e1.synchronize()
            best = min(best, e0.elapsed_time(e1) / 1e3)
    return best


def pinned_gbps(device: str) -> float | None:
    """GB/s of a 256 MiB pinned host -> device copy on a side stream; None without CUDA."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    src = torch.empty(PINNED_BYTES, dtype=torch.uint8).pin_memory()
    dst = torch.empty(PINNED_BYTES, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    secs = _timed(lambda: dst.copy_(src, non_blocking=True), stream, 5)
    return PINNED_BYTES / secs / 1e9


def write_slot_gbps(engine: Any) -> float | None:
    """GB/s of a slot write for one resident adapter (the engine must be idle); None if no
    adapter is resident or there is no CUDA device. The adapter is written again into its own
    slot with its own layout (the rest known to be zero), so nothing changes."""
    internals = engine.testing
    model = internals.executor.model
    if model.device.type != "cuda":
        return None
    slots = internals.adapters.slots
    resident = [v for v in slots.resident if slots.is_ready(v) and v.adapter is not None]
    if not resident:
        return None
    v = resident[0]
    slot, adapter = slots.slot_of(v), v.adapter
    buffers = SlotBuffers(model)
    torch.cuda.synchronize(model.device)
    stream = torch.cuda.Stream(model.device)
    secs = _timed(lambda: buffers.write(slot, adapter, zero_rest=False, had_dora=False), stream, 5)
    return adapter.nbytes / secs / 1e9


def measure_slot_write(
    model: CausalLM,
    packed: PackedAdapter,
    repeats: int = 10,
    *,
    slot: int = 0,
    zero_fill: bool = False,
) -> float:
    """GB/s of a slot write (H2D bytes of ``packed`` over wall time); overwrites ``slot`` (and
    voids what the engine's slot store knows of the slots). Rewrites of one layout skip the
    zero-fill of the rest; ``zero_fill``: every write does it (as a write into a slot that
    held another layout)."""
    cuda = model.device.type == "cuda"
    buffers = SlotBuffers(model)

    def write() -> None:
        buffers.write(slot, packed, zero_rest=zero_fill)

    # warm-up: the staging allocation, and the scatter plan of the timed writes (the first
    # write into a slot of another layout zero-fills: a plan of its own)
    buffers.write(slot, packed)
    buffers.bump()
    write()
    if cuda:
        torch.cuda.synchronize(model.device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        write()
    if cuda:
        torch.cuda.synchronize(model.device)
    return packed.nbytes * repeats / (time.perf_counter() - t0) / 1e9
