"""One caller per event-loop turn: spreads a burst of API calls over the loop.

``asyncio.gather`` of 64 ``add_adapter`` calls (or 24 ``generate`` calls) puts 64 task steps
into one turn of the loop; each does ~0.25 ms of synchronous work (name resolution, the
version, the loader job) before its first wait, so the step loop's own callbacks wait ~16 ms
behind them and every running stream misses a step (H200 storm benchmark, registration of
64). ``Intake.turn()`` lets the first caller of a turn through at once and queues the rest,
FIFO, one per following turn, so the step loop's callbacks run between them.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Intake"]


class Intake:
    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._open = True  # no caller has passed in the current turn

    async def turn(self) -> None:
        """Return once it is this caller's turn (at once if nobody passed in this one)."""
        loop = asyncio.get_running_loop()
        if self._open and not self._waiters:
            self._open = False
            loop.call_soon(self._next)
            return
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        await fut  # a cancelled waiter is skipped by _next

    def _next(self) -> None:
        """A new turn: wake the next waiter (it runs in the turn after), or reopen."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                asyncio.get_running_loop().call_soon(self._next)
                return
        self._open = True
