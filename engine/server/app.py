"""The aiohttp application: OpenAI routes, health, metrics, admin routes when configured.

app = create_app(engine)                     # an engine the caller started and closes
app = create_app_from_config(config, ...)    # the app starts / closes its own engine
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

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
from loraplex.engine.server.errors import APIError, error_middleware
from loraplex.engine.server.state import ENGINE_KEY, METRICS_KEY, base_model_root

if TYPE_CHECKING:
    from loraplex.engine.server.launch import LoraModule

__all__ = ["create_app", "create_app_from_config"]

log = structlog.get_logger("loraplex.server")

MAX_BODY_BYTES = 32 << 20  # token-id prompts are verbose JSON
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


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    base = engine.model_name
    created = int(time.time())
    cards = [
        {
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "loraplex",
            "root": base_model_root(engine),
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
                "root": a["uri"],
                "parent": base,
                "max_model_len": engine.max_model_len,
                "digest": a["digest"],
            }
        )
    return web.json_response({"object": "list", "data": cards})


def _build(admin_token: str | None, metrics_top_k: int) -> web.Application:
    app = web.Application(
        middlewares=[access_log, error_middleware], client_max_size=MAX_BODY_BYTES
    )
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
    engine: AsyncEngine, *, admin_token: str | None = None, metrics_top_k: int = 16
) -> web.Application:
    """An app serving a running ``engine`` (its lifetime stays with the caller).

    ``admin_token``: enables the load / unload routes (None: they do not exist). Run it with
    ``start_server`` (or an ``AppRunner(handler_cancellation=True)``) so that a client hanging
    up also aborts a non-streamed request; streams notice on their next write anyway.
    """
    app = _build(admin_token, metrics_top_k)
    _bind(app, engine)
    return app


def create_app_from_config(
    config: EngineConfig,
    *,
    admin_token: str | None = None,
    lora_modules: Sequence[LoraModule] = (),
    metrics_top_k: int = 16,
) -> web.Application:
    """An app that starts the engine on start-up and closes it on clean-up.

    ``lora_modules`` are registered at start-up (after the demo adapters when ``config.model`` is
    None); a bad one fails the start-up.
    """
    app = _build(admin_token, metrics_top_k)

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        engine = AsyncEngine(config)
        try:
            await engine.start()
            if config.model is None:  # the demo model comes with its demo adapters
                from loraplex.engine.demo import register_demo_adapters

                names = await register_demo_adapters(engine)
                log.info("demo_adapters_registered", names=names)
            for m in lora_modules:
                info = await engine.add_adapter(m.name, m.uri, m.sha256)
                log.info("adapter_registered", name=m.name, uri=m.uri, digest=info["digest"])
            _bind(app, engine)
            log.info("capacity_report", **engine.capacity_report())
            yield
        finally:
            await engine.close()

    app.cleanup_ctx.append(engine_ctx)
    return app
