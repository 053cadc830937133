"""Graceful shutdown: refuse new generations, let running ones finish, abort what is left.

drain.close()                      # new generation requests get 503
done = await drain.wait(timeout)   # True once no reply is running
drain.abort_all()                  # the rest end with finish_reason "abort" + a 503 error
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from loraplex.engine.server.errors import APIError

__all__ = ["Drain", "Abortable", "SHUTDOWN_MESSAGE"]

SHUTDOWN_MESSAGE = "the server is shutting down"


class Abortable(Protocol):
    def abort_for_shutdown(self) -> None:
        """Abort every engine request of this reply (they end with finish_reason "abort")."""
        ...


class Drain:
    """The running replies of one app, for shutdown to wait on."""

    def __init__(self) -> None:
        self.closing = False
        self._active: set[Abortable] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def active(self) -> int:
        return len(self._active)

    def check_open(self) -> None:
        if self.closing:
            raise APIError(503, f"{SHUTDOWN_MESSAGE}: no new requests are accepted")

    def add(self, reply: Abortable) -> None:
        self._active.add(reply)
        self._idle.clear()

    def discard(self, reply: Abortable) -> None:
        self._active.discard(reply)
        if not self._active:
            self._idle.set()

    def close(self) -> None:
        self.closing = True

    async def wait(self, timeout: float) -> bool:
        """Wait until no reply is running (True) or ``timeout`` seconds pass (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort_all(self) -> int:
        """Abort every running reply; returns how many there were."""
        replies = list(self._active)
        for r in replies:
            r.abort_for_shutdown()
        return len(replies)
