"""The OpenAI-compatible ingress: ``loraplex serve``'s aiohttp app on a ``ClusterEngine``.

Same routes, wire shapes, errors and streaming as ``loraplex serve`` (it is the same code);
``/metrics`` adds the routing metrics (metrics.py), ``/health`` is 503 while no replica reports.
"""

from __future__ import annotations

from aiohttp import web

from loraplex.engine.serve_ray.cluster_engine import ClusterEngine
from loraplex.engine.serve_ray.metrics import RoutingCollector
from loraplex.engine.server.app import create_app
from loraplex.engine.server.limits import ServerLimits
from loraplex.engine.server.state import METRICS_KEY

__all__ = ["create_ingress_app"]


def create_ingress_app(
    engine: ClusterEngine,
    *,
    admin_token: str | None = None,
    metrics_top_k: int = 16,
    limits: ServerLimits | None = None,
) -> web.Application:
    """The app on a started ``engine`` (its lifetime stays with the caller)."""
    app = create_app(
        engine,  # type: ignore[arg-type]  # the AsyncEngine surface the routes use
        admin_token=admin_token,
        metrics_top_k=metrics_top_k,
        limits=limits,
    )
    app[METRICS_KEY].registry.register(RoutingCollector(engine.board))
    return app
