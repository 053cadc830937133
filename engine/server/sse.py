"""Server-sent events: ``data: {json}\\n\\n`` chunks ending with ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

__all__ = ["SSEWriter", "dumps", "CLIENT_GONE"]

# What a write to a closed connection raises (aiohttp's ClientConnectionResetError is one).
CLIENT_GONE = (ConnectionResetError, ConnectionError)


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class SSEWriter:
    """Prepares the stream on the first event, so an error before it is still a JSON reply."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    async def start(self) -> web.StreamResponse:
        if self.response is None:
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream; charset=utf-8",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            await resp.prepare(self.request)
            self.response = resp
        return self.response

    async def send(self, data: Any) -> None:
        resp = await self.start()
        await resp.write(f"data: {dumps(data)}\n\n".encode())

    async def done(self) -> None:
        resp = await self.start()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
