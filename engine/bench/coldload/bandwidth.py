"""Host->device bandwidth references measured in the same run (CUDA only; None on CPU).

- ``pinned_gbps``: one 256 MiB pinned->device copy on a side stream (best of a few), the
  ceiling a slot write can reach.
- ``write_slot_gbps``: the engine's own ``write_slot`` of a resident adapter into its own
  slot (same bytes, so nothing changes), timed with CUDA events on a side stream: the copy
  path alone, without the step it waits for or the loop noticing it finished.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["pinned_gbps", "write_slot_gbps"]

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
    """GB/s of ``write_slot`` for one resident adapter (the engine must be idle); None if no
    adapter is resident or there is no CUDA device."""
    from loraplex.engine.model.lora.slot_buffers import write_slot

    internals = engine.testing
    model = internals.executor.model
    if model.device.type != "cuda":
        return None
    resident = [v for v in internals.adapters.resident if v.slot_ready and v.adapter is not None]
    if not resident:
        return None
    v = resident[0]
    slot, adapter = v.slot, v.adapter
    torch.cuda.synchronize(model.device)
    stream = torch.cuda.Stream(model.device)
    secs = _timed(lambda: write_slot(model, slot, adapter), stream, 5)
    return adapter.nbytes / secs / 1e9
