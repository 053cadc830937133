"""The event loop's own lag: how late a due callback runs.

Everything a client sees passes through the loop (scheduling, streaming outputs, HTTP), so a
loop blocked by some callback delays every stream at once. ``LoopLag`` wakes every
``interval`` seconds and records how late it woke; subscribers get a ``loop_lag`` event per
sample (``/metrics`` keeps a histogram) and ``stats()`` the recent p99 and max.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

__all__ = ["LoopLag"]


class LoopLag:
    def __init__(
        self, emit: Callable[[float], None], interval: float = 0.005, keep: int = 2000
    ) -> None:
        self.emit = emit
        self.interval = interval
        self.samples: collections.deque[float] = collections.deque(maxlen=keep)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loraplex-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.interval
            await asyncio.sleep(self.interval)
            lag = max(0.0, time.perf_counter() - due)
            self.samples.append(lag)
            self.emit(lag)

    def summary(self) -> dict[str, float]:
        """p99 and max lag (ms) over the recent samples."""
        xs = sorted(self.samples)
        if not xs:
            return {"loop_lag_p99_ms": 0.0, "loop_lag_max_ms": 0.0}
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        return {"loop_lag_p99_ms": round(p99 * 1e3, 3), "loop_lag_max_ms": round(xs[-1] * 1e3, 3)}
