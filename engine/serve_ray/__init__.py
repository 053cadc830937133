"""loraplex on Ray Serve: engine replicas, adapter-residency routing, the OpenAI ingress.

    from loraplex.engine import EngineConfig
    from loraplex.engine.serve_ray import LocalRay, ReplicaSpec, deploy, serve_cluster

    ray_cluster = LocalRay.start()                                  # 127.0.0.1 only
    handle = deploy(ReplicaSpec(EngineConfig(device="cpu")), replicas=2)
    asyncio.run(serve_cluster(handle, "127.0.0.1", 8000))           # until SIGINT / SIGTERM

Names are imported lazily: ``loraplex serve-ray --help`` imports neither Ray nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.serve_ray.board import Board
    from loraplex.engine.serve_ray.cluster import LocalRay, board_of, deploy, undeploy
    from loraplex.engine.serve_ray.cluster_engine import ClusterEngine, ReplicaFailedError
    from loraplex.engine.serve_ray.ingress import create_ingress_app
    from loraplex.engine.serve_ray.launch import serve_cluster
    from loraplex.engine.serve_ray.replica import EngineReplica, ReplicaSpec
    from loraplex.engine.serve_ray.routing import POLICIES, ReplicaView, rank_replicas

__all__ = [
    "Board",
    "ClusterEngine",
    "EngineReplica",
    "LocalRay",
    "POLICIES",
    "ReplicaFailedError",
    "ReplicaSpec",
    "ReplicaView",
    "board_of",
    "create_ingress_app",
    "deploy",
    "rank_replicas",
    "serve_cluster",
    "undeploy",
]

_WHERE = {
    "Board": "board",
    "ClusterEngine": "cluster_engine",
    "ReplicaFailedError": "cluster_engine",
    "EngineReplica": "replica",
    "ReplicaSpec": "replica",
    "LocalRay": "cluster",
    "board_of": "cluster",
    "deploy": "cluster",
    "undeploy": "cluster",
    "create_ingress_app": "ingress",
    "serve_cluster": "launch",
    "POLICIES": "routing",
    "ReplicaView": "routing",
    "rank_replicas": "routing",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"loraplex.engine.serve_ray.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'loraplex.engine.serve_ray' has no attribute {name!r}")
