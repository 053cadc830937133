"""Closing connections that never send a request (the slow-headers attack).

aiohttp closes a keep-alive connection that stays idle between requests after
``keepalive_timeout``; the body read has its own deadline (``body.read_body``). What is left is
a new connection that sends nothing, or its first headers a byte at a time: ``HeaderDeadline``
closes it ``header_timeout`` seconds after it opened unless a request has been parsed on it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

__all__ = ["HeaderDeadline"]

_TASKS: set[asyncio.Task] = set()  # keeps the watch tasks referenced


class HeaderDeadline:
    def __init__(self, runner: web.AppRunner, timeout: float) -> None:
        self.runner = runner
        self.timeout = timeout
        # NOTE: aiohttp's connection objects take no weak references: entries are pruned to
        # the live connections on every sweep instead.
        self.started: set[Any] = set()  # connections that delivered a request
        self.opened: dict[Any, float] = {}  # when a sweep first saw a connection
        self.closed = 0

    @classmethod
    def attach(cls, runner: web.AppRunner, timeout: float) -> HeaderDeadline:
        """Watch ``runner``'s connections until it is cleaned up. Call before a site starts
        (connections made earlier read the request factory before the hook is in place)."""
        self = cls(runner, timeout)
        server = runner.server
        assert server is not None, "attach after runner.setup()"
        factory = server.request_factory

        def marking_factory(message: Any, payload: Any, protocol: Any, *args: Any) -> Any:
            self.started.add(protocol)
            return factory(message, payload, protocol, *args)

        server.request_factory = marking_factory
        task = asyncio.get_running_loop().create_task(self._watch(), name="loraplex-headers")
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)
        return self

    def sweep(self, now: float) -> None:
        server = self.runner.server
        if server is None:
            return
        live = set(server.connections)
        self.started &= live
        self.opened = {c: t for c, t in self.opened.items() if c in live}
        for conn in live:
            if conn in self.started:
                continue
            opened = self.opened.setdefault(conn, now)
            if now - opened >= self.timeout:
                self.closed += 1
                conn.force_close()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        period = min(1.0, self.timeout / 4)
        while self.runner.server is not None:
            self.sweep(loop.time())
            await asyncio.sleep(period)
