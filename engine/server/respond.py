"""Drive a ``FanOut`` and send the reply: one JSON body, or an SSE stream of chunks.

The route modules say how a reply looks (``ReplyShape``); this module says when things are
sent and what happens on errors and disconnects.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import structlog
from aiohttp import web

from loraplex.engine.adapters.lifecycle import AdapterChoice
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.request import RequestOutput
from loraplex.engine.server.drain import SHUTDOWN_MESSAGE
from loraplex.engine.server.errors import APIError, from_exception
from loraplex.engine.server.generation import FanOut, Job, Reply, usage
from loraplex.engine.server.limits import flag
from loraplex.engine.server.protocol import GenerationRequest
from loraplex.engine.server.sse import CLIENT_GONE, SSEWriter
from loraplex.engine.server.state import DRAIN_KEY, LIMITS_KEY

__all__ = ["ReplyShape", "respond"]

log = structlog.get_logger("loraplex.server")


class ReplyShape(Protocol):
    chunk_object: str

    def opening(self, reply: Reply) -> list[dict[str, Any]]:
        """Chunks sent once the stream starts (chat: the assistant role of every choice)."""
        ...

    def delta(self, job: Job, out: RequestOutput) -> dict[str, Any] | None:
        """One streamed choice for ``out`` (None: nothing worth sending)."""
        ...

    def body(self, reply: Reply) -> dict[str, Any]:
        """The whole non-streamed reply."""
        ...


def _fan(request: web.Request, engine: AsyncEngine, reply: Reply, adapter: AdapterChoice) -> FanOut:
    return FanOut(engine, reply.jobs, adapter, request.app.get(DRAIN_KEY))


def _shutdown_error(request: web.Request) -> APIError:
    limits = request.app.get(LIMITS_KEY)
    waited = f" after {limits.shutdown_timeout:g} s ({flag('shutdown_timeout')})" if limits else ""
    return APIError(503, f"{SHUTDOWN_MESSAGE}: the request was aborted{waited}")


def _chunk(reply: Reply, shape: ReplyShape, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": reply.id,
        "object": shape.chunk_object,
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
    }


async def respond(
    request: web.Request,
    engine: AsyncEngine,
    req: GenerationRequest,
    reply: Reply,
    shape: ReplyShape,
    adapter: AdapterChoice,
) -> web.StreamResponse:
    if not req.stream:
        async with _fan(request, engine, reply, adapter) as fan:
            try:
                async for job, out in fan:
                    reply.choices[job.index].add(out)
            except Exception as e:  # noqa: BLE001
                if fan.shut_down:
                    raise _shutdown_error(request) from e
                raise from_exception(e, model=req.model) from e
        if fan.shut_down:
            raise _shutdown_error(request)
        return web.json_response(shape.body(reply))
    return await _stream(request, engine, req, reply, shape, adapter)


async def _stream(
    request: web.Request,
    engine: AsyncEngine,
    req: GenerationRequest,
    reply: Reply,
    shape: ReplyShape,
    adapter: AdapterChoice,
) -> web.StreamResponse:
    sse = SSEWriter(request)
    try:
        async with _fan(request, engine, reply, adapter) as fan:
            try:
                async for job, out in fan:
                    if not sse.started:
                        for chunk in shape.opening(reply):
                            await sse.send(chunk)
                    reply.choices[job.index].add(out)
                    choice = shape.delta(job, out)
                    if choice is not None:
                        chunk = _chunk(reply, shape, [choice])
                        if req.include_usage:
                            chunk["usage"] = None
                        await sse.send(chunk)
            except CLIENT_GONE:
                raise
            except Exception as e:  # noqa: BLE001
                err = (
                    _shutdown_error(request)
                    if fan.shut_down
                    else from_exception(e, model=req.model)
                )
                if not sse.started:
                    raise err from e
                await sse.send(err.body())  # headers are out: the error travels in the stream
                await sse.done()
                return sse.response  # type: ignore[return-value]
        if req.include_usage:
            await sse.send({**_chunk(reply, shape, []), "usage": usage(reply)})
        if fan.shut_down:  # the choices ended with finish_reason "abort"; say why
            await sse.send(_shutdown_error(request).body())
        await sse.done()
    except CLIENT_GONE:
        log.info("client_disconnected", path=request.path, reply_id=reply.id)
    except asyncio.CancelledError:
        log.info("client_disconnected", path=request.path, reply_id=reply.id)
        raise
    return sse.response if sse.response is not None else web.Response(status=499)
