"""Typed application keys shared by the route modules."""

from __future__ import annotations

from aiohttp import web

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.metrics import Metrics

__all__ = ["ENGINE_KEY", "METRICS_KEY", "ADMIN_TOKEN_KEY", "base_model_root"]

ENGINE_KEY = web.AppKey("loraplex_engine", AsyncEngine)
METRICS_KEY = web.AppKey("loraplex_metrics", Metrics)
ADMIN_TOKEN_KEY = web.AppKey("loraplex_admin_token", str)


def base_model_root(engine: AsyncEngine) -> str:
    """The base model's path (the demo model's folder when none was configured)."""
    core = engine.core
    model = core.config.model if core is not None else engine.config.model
    return str(model) if model is not None else "demo"
