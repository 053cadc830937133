"""A burst of API calls let through one at a time, ``SPACING_S`` apart.

``asyncio.gather`` of 64 ``add_adapter`` calls (or 24 ``generate`` calls) puts 64 task steps
into one turn of the loop; each does ~0.25 ms of synchronous work (name resolution, the
version, the loader job) before its first wait, so the step loop's own callbacks wait ~16 ms
behind them and every running stream misses a step. Letting one caller through per loop turn
is not enough: it moves the step loop's callbacks between them, but the loop still runs back to
back for those ~16 ms and the step thread, which needs the GIL to launch a step, gets it only
at the interpreter's switch interval, so one step per burst comes 3-9 ms late (its GPU idle).

``Intake.turn()`` lets the first caller of a loop turn through at once (when nobody waits);
the others of that turn, and any caller while some wait, queue FIFO and pass one per
``spacing`` seconds. A burst of 64 then takes ~64 ms at 1 ms spacing, the loop busy about a
quarter of it, so the step thread launches on time; a caller in a later turn with nobody
waiting pays nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["SPACING_S", "Intake"]

SPACING_S = 0.001


class Intake:
    def __init__(self, spacing: float | None = None) -> None:
        self.spacing = SPACING_S if spacing is None else spacing
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._open = True  # nobody passed in the current loop turn, nobody waits
        self._last = float("-inf")  # loop.time() of the last caller let through
        self._timer: asyncio.TimerHandle | None = None

    async def turn(self) -> None:
        """Return once it is this caller's turn (at once if it is the turn's first)."""
        loop = asyncio.get_running_loop()
        if self._open and not self._waiters:
            self._open = False
            self._last = loop.time()
            loop.call_soon(self._reopen)
            return
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        if self._timer is None:
            self._timer = loop.call_at(self._last + self.spacing, self._next)
        await fut  # a cancelled waiter is skipped by _next

    def _reopen(self) -> None:
        """A later loop turn: open again unless callers wait (the timer lets them through)."""
        if not self._waiters:
            self._open = True

    def _next(self) -> None:
        """Wake the next waiter (it runs in the turn after) and time the one behind it."""
        self._timer = None
        loop = asyncio.get_running_loop()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self._last = loop.time()
                break
        if self._waiters:
            self._timer = loop.call_at(self._last + self.spacing, self._next)
        else:
            loop.call_soon(self._reopen)
