"""Work in a thread that writes into memory someone else will reuse (a host-pool region): a
cancelled caller must not hand the memory back while the thread still writes into it.

``asyncio.to_thread`` returns at once when its caller is cancelled while the thread runs on;
``run_to_end`` asks the work to stop (``stop`` is set; the work checks it between steps) and
waits for the thread to return before the cancellation propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["PriorityGate", "StageStopped", "run_to_end"]

T = TypeVar("T")


class StageStopped(Exception):
    """Raised inside the thread's work when its ``stop`` event is set (the caller is gone)."""


async def run_to_end(fn: Callable[[threading.Event], T]) -> T:
    """``fn(stop)`` in the loop's default executor. If the caller is cancelled, ``stop`` is
    set and the cancellation is re-raised only once ``fn`` has returned (however often the
    caller is cancelled meanwhile)."""
    stop = threading.Event()
    fut = asyncio.get_running_loop().run_in_executor(None, fn, stop)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        stop.set()
        while not fut.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)
        if not fut.cancelled():
            fut.exception()  # retrieved: the work's own error (StageStopped) is not news
        raise


class PriorityGate:
    """One holder at a time; waiting urgent holders go before waiting others. A loader
    helper's GIL-bound work: a stage (a request waits on it) before registration checks."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._urgent = 0  # urgent holders waiting

    @contextlib.contextmanager
    def hold(self, *, urgent: bool) -> Iterator[None]:
        with self._cond:
            self._urgent += urgent
            try:
                while self._busy or (not urgent and self._urgent):
                    self._cond.wait()
            finally:
                self._urgent -= urgent
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
