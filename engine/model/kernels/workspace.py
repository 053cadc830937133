"""Per-device buffers the kernels share across launches (split-K counters, partial sums, unit
scales): made once per device, outside any CUDA graph capture.

A buffer made inside a capture would have its fill recorded into the graph instead of run,
and would live in the graph's private pool; so each kernel module exposes a ``prepare_*``
that the engine calls at start-up, and a first use inside a capture is refused loudly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["per_device"]

T = TypeVar("T")


def per_device(
    cache: dict[torch.device, T], device: torch.device | str, make: Callable[[torch.device], T],
    what: str,
) -> T:  # fmt: skip
    """``cache[device]``, made by ``make(device)`` on first use (``cuda`` and
    ``cuda:<current>`` are one device). ``what`` names the ``prepare_*`` function for the
    error raised when the first use falls inside a CUDA graph capture."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    got = cache.get(device)
    if got is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what}(device) must run before CUDA graph capture")
        got = cache[device] = make(device)
    return got
