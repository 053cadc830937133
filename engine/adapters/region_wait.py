"""Loads waiting for host memory: a free host-pool region, an idle CPU-tier version evicted
for one, or a wait until a change may have freed one.

Waiters look again when told (``room_changed``: a region was released, or a CPU-tier version
became evictable: its last request ended, it left its GPU slot, a load ended), not on a timer:
16 waiters polling every 2 ms, each poll scanning every version for one to evict, took a core
of the event loop at ~150 cold requests/s (BENCHMARKS.md, "Cold-load rate"). Waiters woken
together ask the registry for a victim once: after one found none, the others know it until
the next change. A released region whose last copy out of it is still landing is looked for
every ``DRAIN_POLL_S`` (no event tells its end); without one, every ``ROOM_POLL_S`` (a safety
net: every change that frees room says so).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from loraplex.engine.adapters.host_pool import HostPool, Region

__all__ = ["DRAIN_POLL_S", "ROOM_POLL_S", "RegionWaiter"]

DRAIN_POLL_S = 0.005
ROOM_POLL_S = 0.1


class RegionWaiter:
    """Event loop only. ``make_room``: the registry's (evict one idle CPU-tier version; its
    region goes back to the pool and it calls ``room_changed``)."""

    def __init__(self, pool: HostPool | None) -> None:
        self.pool = pool
        self.make_room: Callable[[], bool] = lambda: False
        self._room = asyncio.Event()
        self._gen = 0  # room_changed calls (and safety-net passes) so far
        self._no_victim_gen = -1  # the generation at which make_room last found no victim

    def room_changed(self) -> None:
        """Host memory may have come free (see the module docstring)."""
        self._gen += 1
        self._room.set()

    def now(self) -> Region | None:
        """A free region now, else None: for work no request waits on (add_adapter's pass),
        which neither queues for host memory nor evicts for it (the CPU tier's policy decides,
        once the image is made, whether it stays: ``AdapterRegistry.admit``)."""
        assert self.pool is not None
        return self.pool.acquire()

    async def acquire(self) -> Region:
        """A free region; evicts idle CPU-tier versions for one, else waits."""
        pool = self.pool
        assert pool is not None
        while True:
            self._room.clear()
            region = pool.acquire()
            if region is not None:
                return region
            if pool.free_count == 0 and self._evict_one():
                continue
            draining = pool.free_count > 0  # released, a copy out still landing
            try:
                await asyncio.wait_for(self._room.wait(), DRAIN_POLL_S if draining else ROOM_POLL_S)
            except asyncio.TimeoutError:  # (3.10: not the builtin TimeoutError)
                self._gen += 1  # the safety net: look once more

    def _evict_one(self) -> bool:
        if self._no_victim_gen == self._gen:
            return False
        if self.make_room():
            return True
        self._no_victim_gen = self._gen
        return False
