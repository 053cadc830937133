"""The event loop's own lag: how late a due callback runs.

Everything a client sees passes through the loop (scheduling, streaming outputs, HTTP), so a
loop blocked by some callback delays every stream at once. ``LoopLag`` posts a callback to the
loop every ``interval`` seconds from a small thread and records how long it waited to run;
subscribers get a ``loop_lag`` event per sample (``/metrics`` keeps a histogram) and
``stats()`` the recent p99 and max.

Why a thread and not ``asyncio.sleep``: a timer's lateness includes the selector's timeout
rounding (``epoll_wait`` takes whole milliseconds, rounded up, so an idle loop wakes a 5 ms
timer 0-1 ms late). A callback posted with ``call_soon_threadsafe`` wakes the loop at once,
so what it waits is the callbacks ahead of it: the loop's own lag. (The probe may itself wait
for the GIL before posting, at most a switch interval, which it does not count.)
"""

from __future__ import annotations

import asyncio
import collections
import threading
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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling the running loop."""
        loop = asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._probe, args=(loop,), name="loraplex-loop-lag", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            await asyncio.to_thread(thread.join, 5.0)

    def _probe(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.wait(self.interval):
            try:
                loop.call_soon_threadsafe(self._arrived, time.perf_counter())
            except RuntimeError:  # the loop closed
                return

    def _arrived(self, posted: float) -> None:
        lag = time.perf_counter() - posted
        self.samples.append(lag)
        self.emit(lag)

    def summary(self) -> dict[str, float]:
        """p99 and max lag (ms) over the recent samples."""
        xs = sorted(self.samples)
        if not xs:
            return {"loop_lag_p99_ms": 0.0, "loop_lag_max_ms": 0.0}
        p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        return {"loop_lag_p99_ms": round(p99 * 1e3, 3), "loop_lag_max_ms": round(xs[-1] * 1e3, 3)}
