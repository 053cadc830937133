"""The aiohttp application: OpenAI routes, health, metrics, admin routes when configured.

app = create_app(engine)                     # an engine the caller started and closes
app = create_app_from_config(config, ...)    # the app starts / closes its own engine
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.aiohttp import make_aiohttp_handler

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.metrics import Metrics
from loraplex.engine.server.admin import add_admin_routes
from loraplex.engine.server.chat import create_chat_completion
from loraplex.engine.server.completions import create_completion
from loraplex.engine.server.drain import Drain
from loraplex.engine.server.errors import APIError, error_middleware
from loraplex.engine.server.limits import ServerLimits
from loraplex.engine.server.lora_modules import LoraModule, check_lora_modules
from loraplex.engine.server.state import (
    ADMIN_TOKEN_KEY,
    DRAIN_KEY,
    ENGINE_KEY,
    LIMITS_KEY,
    METRICS_KEY,
    PREP_POOL_KEY,
    base_model_root,
)

__all__ = ["create_app", "create_app_from_config"]

log = structlog.get_logger("loraplex.server")

_PREP_THREADS = 2  # tokenization / chat-template threads per app
_QUIET_PATHS = frozenset({"/health", "/metrics"})  # scraped often: logged at debug level


@web.middleware
async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """At most one log line per HTTP request (the engine logs one line per engine request)."""
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as e:
        status = e.status
        raise
    except BaseException:
        status = 499  # handler cancelled: the client went away
        raise
    finally:
        emit = log.debug if request.path in _QUIET_PATHS else log.info
        emit(
            "http",
            method=request.method,
            path=request.path,
            status=status,
            seconds=round(time.perf_counter() - t0, 6),
            remote=request.remote,
        )


async def health(request: web.Request) -> web.Response:
    engine = request.app.get(ENGINE_KEY)
    try:
        if engine is None:
            raise RuntimeError
        engine.stats()
    except Exception:  # noqa: BLE001
        raise APIError(503, "the engine is not running") from None
    return web.Response(status=200)


def _is_admin(request: web.Request) -> bool:
    """The request carries the admin bearer token (no error otherwise: clients send API keys)."""
    token = request.app.get(ADMIN_TOKEN_KEY)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if token is None or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


async def list_models(request: web.Request) -> web.Response:
    """Model cards; where adapters and the base model come from (local paths, bucket URIs) is
    operator information, shown only to a request with the admin token."""
    engine = request.app[ENGINE_KEY]
    base = engine.model_name
    created = int(time.time())
    admin = _is_admin(request)
    cards = [
        {
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "loraplex",
            "root": base_model_root(engine) if admin else base,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
    ]
    for a in engine.list_adapters():
        cards.append(
            {
                "id": a["name"],
                "object": "model",
                "created": created,
                "owned_by": "loraplex",
                "root": a["uri"] if admin else a["name"],
                "parent": base,
                "max_model_len": engine.max_model_len,
                "digest": a["digest"],
            }
        )
    return web.json_response({"object": "list", "data": cards})


def _yield_cpu() -> None:
    """Prep threads run at a lower priority than the step thread and the event loop.

    NOTE: tokenizing a long prompt releases the GIL but still fills a core; on a small machine
    that core is the one the step thread needed (Linux: nice is per thread).
    """
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


async def _warm_prep(app: web.Application) -> None:
    """Tokenize once in the pool at start-up: the first encode sets up the tokenizer's own
    thread pool (measured: one ~150 ms stall of the first request's neighbours otherwise)."""
    engine = app[ENGINE_KEY]
    if engine.tokenizer is not None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(app[PREP_POOL_KEY], engine.tokenizer.encode_batch, ["warm"])


async def _prep_pool(app: web.Application) -> AsyncIterator[None]:
    pool = ThreadPoolExecutor(
        _PREP_THREADS, thread_name_prefix="loraplex-prep", initializer=_yield_cpu
    )
    app[PREP_POOL_KEY] = pool
    if ENGINE_KEY in app:  # create_app: the engine runs already
        await _warm_prep(app)
    yield
    pool.shutdown(wait=False, cancel_futures=True)


def _build(
    admin_token: str | None, metrics_top_k: int, limits: ServerLimits | None
) -> web.Application:
    limits = limits or ServerLimits()
    app = web.Application(
        middlewares=[access_log, error_middleware],
        client_max_size=limits.max_request_body_bytes,
    )
    app[LIMITS_KEY] = limits
    app[DRAIN_KEY] = Drain()
    app.cleanup_ctx.append(_prep_pool)
    metrics = Metrics(top_k=metrics_top_k)
    app[METRICS_KEY] = metrics
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", make_aiohttp_handler(metrics.registry))
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    if admin_token is not None:
        add_admin_routes(app, admin_token)
    return app


def _bind(app: web.Application, engine: AsyncEngine) -> None:
    app[ENGINE_KEY] = engine
    app[METRICS_KEY].attach(engine)


def create_app(
    engine: AsyncEngine,
    *,
    admin_token: str | None = None,
    metrics_top_k: int = 16,
    limits: ServerLimits | None = None,
) -> web.Application:
    """An app serving a running ``engine`` (its lifetime stays with the caller).

    ``admin_token``: enables the load / unload routes (None: they do not exist). ``limits``:
    what one request may cost (default ``ServerLimits()``). Run it with ``start_server`` (or an
    ``AppRunner(handler_cancellation=True)``) so that a client hanging up also aborts a
    non-streamed request; streams notice on their next write anyway.
    """
    app = _build(admin_token, metrics_top_k, limits)
    _bind(app, engine)
    return app


def create_app_from_config(
    config: EngineConfig,
    *,
    admin_token: str | None = None,
    lora_modules: Sequence[LoraModule] = (),
    metrics_top_k: int = 16,
    limits: ServerLimits | None = None,
) -> web.Application:
    """An app that starts the engine on start-up and closes it on clean-up.

    ``lora_modules`` are registered at start-up (after the demo adapters when ``config.model`` is
    None); a bad one (or one whose name is taken) fails the start-up.
    """
    app = _build(admin_token, metrics_top_k, limits)

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        engine = AsyncEngine(config)
        try:
            await engine.start()
            if config.model is None:  # the demo model comes with its demo adapters
                from loraplex.engine.demo import register_demo_adapters

                names = await register_demo_adapters(engine)
                log.info("demo_adapters_registered", names=names)
            taken = [engine.model_name, *(a["name"] for a in engine.list_adapters())]
            check_lora_modules(lora_modules, taken)
            for m in lora_modules:
                info = await engine.add_adapter(m.name, m.uri, m.sha256)
                log.info("adapter_registered", name=m.name, uri=m.uri, digest=info["digest"])
            _bind(app, engine)
            await _warm_prep(app)
            log.info("capacity_report", **engine.capacity_report())
            yield
        finally:
            await engine.close()

    app.cleanup_ctx.append(engine_ctx)
    return app
