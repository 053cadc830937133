"""The host pool: fixed slot-image buffers in shared, pinned host memory, made once at start-up.

Every CPU-tier adapter lives in one region (``region_bytes`` = the largest packed adapter, see
``staging.slot_image_numel``). The pool is one ``memfd`` mapping: loader processes map the same
pages and pack adapters straight into a region; on CUDA the engine registers the mapping with
``cudaHostRegister`` once, so slot writes copy from it asynchronously at full pinned bandwidth.

Why not ``torch.empty(pin_memory=True)`` per load: a new 84 MB pinned allocation
(cudaHostAlloc) takes ~70 ms and stalls other threads' CUDA calls for as long, a cudaFreeHost
~12 ms (``benchmarks/host_memory.py``). Nothing here allocates while serving.

A region is reused only after the last host -> device copy out of it completed: ``release``
takes the CUDA event recorded after that copy, and ``acquire`` hands out a region only once
its event has completed. Thread-safe (adapters may be dropped on the step thread).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostPool", "Region"]

_ALIGN = 1 << 12  # regions start on page boundaries


@dataclass(frozen=True)
class Region:
    index: int
    offset: int  # bytes from the start of the pool
    nbytes: int


class HostPool:
    def __init__(self, region_bytes: int, count: int, *, register_cuda: bool = False) -> None:
        if count < 1 or region_bytes < 1:
            raise ValueError("a host pool needs at least one non-empty region")
        self.region_bytes = -(-region_bytes // _ALIGN) * _ALIGN
        self.count = count
        self.nbytes = self.region_bytes * count
        # NOTE: a memfd, not /dev/shm: container /dev/shm mounts are often 64 MB
        self.fd = os.memfd_create("loraplex-host-pool", 0)
        os.ftruncate(self.fd, self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)  # (nbytes,)
        self._registered = False
        if register_cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.nbytes}-byte host pool: {rc}")
            self._registered = True
        self._lock = threading.Lock()
        self._free: list[int] = list(range(count))
        self._draining: list[tuple[int, Any]] = []  # (index, event of the last copy out of it)
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free) + len(self._draining)

    def region(self, index: int) -> Region:
        return Region(index, index * self.region_bytes, self.region_bytes)

    def view(self, region: Region, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """The region as a flat tensor of ``dtype`` (its first ``numel`` elements)."""
        elem = torch.empty((), dtype=dtype).element_size()
        n = region.nbytes // elem if numel is None else numel
        if n * elem > region.nbytes:
            raise ValueError(f"{n} x {dtype} does not fit a {region.nbytes}-byte region")
        return self.tensor[region.offset : region.offset + n * elem].view(dtype)

    def acquire(self) -> Region | None:
        """A free region whose last copy-out completed, or None."""
        with self._lock:
            for i, (index, event) in enumerate(self._draining):
                if event is None or event.query():
                    del self._draining[i]
                    self._free.append(index)
                    break
            if not self._free:
                return None
            index = self._free.pop()
            self._used.add(index)
            return self.region(index)

    def release(self, region: Region, event: Any = None) -> None:
        """Give ``region`` back; ``event``: recorded after the last copy out of it, if any."""
        with self._lock:
            if region.index not in self._used:
                raise ValueError(f"region {region.index} is not in use")
            self._used.discard(region.index)
            self._draining.append((region.index, event))

    def in_use(self) -> int:
        with self._lock:
            return len(self._used)

    def close(self) -> None:
        if self._registered:
            torch.cuda.synchronize()  # no slot write may still read the pages
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        self.tensor = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # views still alive: the mapping goes with them
            self._map.close()
        os.close(self.fd)
