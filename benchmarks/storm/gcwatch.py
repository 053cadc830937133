"""Garbage-collector pauses during the storm: a cyclic collection stops every thread that
needs the GIL (the event loop delivering tokens, the step thread launching), so its pauses
are read per window beside the gaps."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class GcWatch:
    """Records (start perf_counter, generation, seconds, thread name) of every collection
    between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, float, str]] = []
        self._began: dict[int, float] = {}

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._began[me] = time.perf_counter()
            return
        t0 = self._began.pop(me, None)
        if t0 is not None:
            name = threading.current_thread().name
            self.events.append((t0, info["generation"], time.perf_counter() - t0, name))

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Per generation: count, total ms, max ms of the collections that began in [t0, t1];
        and the threads of the pauses over 0.5 ms."""
        out: dict[str, Any] = {}
        for gen in (0, 1, 2):
            d = [s for t, g, s, _ in self.events if g == gen and t0 <= t <= t1]
            out[f"gen{gen}"] = [len(d), round(sum(d) * 1e3, 2), round(max(d, default=0) * 1e3, 2)]
        long = [n for t, _, s, n in self.events if t0 <= t <= t1 and s > 5e-4]
        out["over_0.5ms_by_thread"] = {n: long.count(n) for n in sorted(set(long))}
        return out
