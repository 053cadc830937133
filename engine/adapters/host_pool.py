"""The host pool: fixed slot-image buffers in shared, pinned host memory, made once at start-up.
On the CPU the same pool, pre-faulted instead of pinned: a load packs into pages that exist.

Every CPU-tier adapter lives in one region (``region_bytes`` = the largest packed adapter, see
``staging.slot_image_numel``). The pool is one ``memfd`` mapping: loader processes map the same
pages and pack adapters straight into a region; on CUDA the engine registers the mapping with
``cudaHostRegister`` once, so slot writes copy from it asynchronously at full pinned bandwidth.

Why not ``torch.empty(pin_memory=True)`` per load: a new 84 MB pinned allocation
(cudaHostAlloc) takes ~70 ms and stalls other threads' CUDA calls for as long, a cudaFreeHost
~12 ms (``benchmarks/host_memory.py``). Nothing here allocates while serving.

A region is reused only after every host -> device copy out of it completed: a slot write
holds its region from when it is planned (``hold``) until its copy is issued, then drops the
hold with the CUDA event recorded after that copy (``unhold``); ``acquire`` hands out a
released region only once no hold remains and every such event has completed. So a region is
never refilled while a copy out of it is queued or in flight, whether or not its adapter is
still in the CPU tier. Thread-safe (holds are dropped on the slot writer's thread).
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
_PREFAULT_BYTES = 64 << 20  # (a CPU pool is touched in slices: no thread waits long on it)


@dataclass(frozen=True)
class Region:
    index: int
    offset: int  # bytes from the start of the pool
    nbytes: int


class HostPool:
    def __init__(
        self, region_bytes: int, count: int, *, register_cuda: bool = False, prefault: bool = False
    ) -> None:
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
        if prefault:  # every page backed now, not at a load's first touch of it
            for lo in range(0, self.nbytes, _PREFAULT_BYTES):
                self.tensor[lo : lo + _PREFAULT_BYTES].zero_()
        if register_cuda:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.nbytes}-byte host pool: {rc}")
            self._registered = True
        self._lock = threading.Lock()
        self._free: list[int] = list(range(count))
        self._draining: list[int] = []  # released, waiting for its copies out of it
        self._used: set[int] = set()
        self._holds: dict[int, int] = {}  # index -> slot writes planned, copy not issued yet
        self._events: dict[int, list[Any]] = {}  # index -> events of copies out of it

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
        """A free region no copy out of it is queued for or still reads, or None."""
        with self._lock:
            for i, index in enumerate(self._draining):
                if self._idle(index):
                    del self._draining[i]
                    self._free.append(index)
                    break
            if not self._free:
                return None
            index = self._free.pop()
            self._used.add(index)
            return self.region(index)

    def _idle(self, index: int) -> bool:
        """(lock held) No slot write holds ``index`` and every copy out of it completed."""
        if self._holds.get(index, 0):
            return False
        events = self._events.get(index)
        if events:
            events[:] = [e for e in events if not e.query()]
            if events:
                return False
        return True

    def hold(self, region: Region) -> None:
        """A slot write out of ``region`` is planned: the region is not reused until the write
        drops this hold (``unhold``) and its copy completed."""
        with self._lock:
            self._holds[region.index] = self._holds.get(region.index, 0) + 1

    def unhold(self, region: Region, event: Any = None) -> None:
        """The planned write's copy out of ``region`` is issued; ``event``: recorded after it
        (None: it completed already, or never ran)."""
        with self._lock:
            n = self._holds.get(region.index, 0)
            if n <= 0:
                raise ValueError(f"region {region.index} is not held")
            self._holds[region.index] = n - 1
            if event is not None:
                events = self._events.setdefault(region.index, [])
                events[:] = [e for e in events if not e.query()]  # (an adapter written often)
                events.append(event)

    def holds(self, region: Region) -> int:
        """Slot writes planned out of ``region`` whose copy is not issued yet."""
        with self._lock:
            return self._holds.get(region.index, 0)

    def release(self, region: Region) -> None:
        """Give ``region`` back (its adapter left the CPU tier): reusable once no write holds
        it and every copy out of it completed."""
        with self._lock:
            if region.index not in self._used:
                raise ValueError(f"region {region.index} is not in use")
            self._used.discard(region.index)
            self._draining.append(region.index)

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
