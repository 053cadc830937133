"""Typed application keys shared by the route modules."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.metrics import Metrics
from loraplex.engine.server.drain import Drain
from loraplex.engine.server.limits import ServerLimits

__all__ = [
    "ENGINE_KEY",
    "METRICS_KEY",
    "ADMIN_TOKEN_KEY",
    "LIMITS_KEY",
    "BODY_DECODED_KEY",
    "DRAIN_KEY",
    "PREP_POOL_KEY",
    "base_model_root",
]

ENGINE_KEY = web.AppKey("loraplex_engine", AsyncEngine)
METRICS_KEY = web.AppKey("loraplex_metrics", Metrics)
ADMIN_TOKEN_KEY = web.AppKey("loraplex_admin_token", str)
LIMITS_KEY = web.AppKey("loraplex_limits", ServerLimits)
# True when the server runs with auto_decompress=False: the app decodes Content-Encoding itself.
BODY_DECODED_KEY = web.AppKey("loraplex_body_decoded_by_app", bool)
DRAIN_KEY = web.AppKey("loraplex_drain", Drain)
# Tokenization and chat-template rendering run here, never on the event loop.
PREP_POOL_KEY = web.AppKey("loraplex_prep_pool", ThreadPoolExecutor)


def base_model_root(engine: AsyncEngine) -> str:
    """The base model's path (the demo model's folder when none was configured)."""
    return engine.model_root or "demo"
