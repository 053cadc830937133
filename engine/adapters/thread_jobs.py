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
from collections.abc import Callable
from typing import TypeVar

__all__ = ["StageStopped", "run_to_end"]

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
