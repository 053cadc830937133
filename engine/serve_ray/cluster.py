"""Start (or join) Ray, deploy the engine replicas on Ray Serve, build the ingress app.

    ray_cluster = LocalRay.start()                      # or LocalRay.join("ray://...:10001")
    handle = deploy(ReplicaSpec(config), replicas=2)    # blocks until every replica is up
    async with ClusterEngine(handle, board_of(handle)) as engine:
        app = create_app(engine)                        # loraplex serve's routes, as they are
    undeploy(); ray_cluster.stop()

A local cluster binds and talks on the loopback only: Ray's node IP is 127.0.0.1 (Ray's
single-machine mode, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), the dashboard is off unless
asked for, and its session files live in an own temporary folder. Ray Serve's HTTP proxy is
off: the ingress is loraplex's own aiohttp server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import structlog

from loraplex.engine.serve_ray.board import Board
from loraplex.engine.serve_ray.loopback import ENV as LOOPBACK_ENV
from loraplex.engine.serve_ray.replica import EngineReplica, ReplicaSpec
from loraplex.engine.serve_ray.router import ROUTER_CLASS
from loraplex.engine.serve_ray.routing import POLICIES

__all__ = ["LocalRay", "deploy", "undeploy", "board_of", "APP_NAME", "DEPLOYMENT_NAME"]

log = structlog.get_logger("loraplex.serve_ray")

APP_NAME = "loraplex"
DEPLOYMENT_NAME = "engine"
STATS_PERIOD_S = 0.25  # how often Ray Serve polls each replica's residency
_LOOPBACK_ENV = {
    # Ray's single-machine mode: the node IP is the loopback address, not the host's own
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage report leaves the machine
    LOOPBACK_ENV: "1",  # the replicas' own gRPC server binds 127.0.0.1 too (loopback.py)
}


@dataclass
class LocalRay:
    """A Ray connection: a local loopback cluster this process started, or a joined one."""

    address: str | None = None  # None: local
    temp_dir: str | None = None
    _own_temp: bool = field(default=False, repr=False)

    @classmethod
    def start(
        cls,
        *,
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        dashboard: bool = False,
        temp_dir: str | None = None,
    ) -> LocalRay:
        """Start a local one-node cluster on 127.0.0.1 (its own temp dir unless given)."""
        import ray
        from ray._private import ray_constants

        os.environ.update(_LOOPBACK_ENV)  # Ray's processes inherit it
        # NOTE: Ray reads the switch when it is imported; this process may have imported it
        ray_constants.ENABLE_RAY_CLUSTER = False
        own = temp_dir is None
        # NOTE: short path: Ray's unix sockets live under it (108-byte limit)
        temp_dir = temp_dir or tempfile.mkdtemp(prefix="lpx-ray-", dir="/tmp")
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            _temp_dir=temp_dir,
            log_to_driver=False,
            configure_logging=False,
        )
        node_ip = ray.util.get_node_ip_address()
        started = cls(None, temp_dir, own)
        if node_ip != "127.0.0.1":
            started.stop()
            raise RuntimeError(f"the local Ray node took the address {node_ip}, not 127.0.0.1")
        log.info("ray_started", node_ip=node_ip, temp_dir=temp_dir, dashboard=dashboard)
        return started

    @classmethod
    def join(cls, address: str) -> LocalRay:
        """Connect to the running cluster at ``address`` (``auto``, ``HOST:PORT``, ``ray://``)."""
        import ray

        ray.init(address=address, log_to_driver=False, configure_logging=False)
        log.info("ray_joined", address=address)
        return cls(address)

    def stop(self) -> None:
        """Leave the cluster (a local one shuts down, its temp dir removed)."""
        import ray

        ray.shutdown()
        if self._own_temp and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _replica_resources(spec: ReplicaSpec) -> dict[str, Any]:
    """One GPU per replica when the engine runs on CUDA (``auto``: when the cluster has GPUs),
    else one CPU."""
    import ray

    device = spec.config.device
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    return {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}


def deploy(
    spec: ReplicaSpec,
    *,
    replicas: int,
    policy: str = "residency",
    max_imbalance: int = 8,
    board: str = "loraplex",
    ray_actor_options: dict[str, Any] | None = None,
    max_ongoing_requests: int = 1024,
) -> Any:
    """Deploy ``replicas`` engine replicas (blocks until they run); returns the handle.

    ``ray_actor_options``: resources of one replica (default: one GPU on CUDA, else one CPU).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; expected one of {POLICIES}")
    if max_imbalance < 0:
        raise ValueError(f"the imbalance bound must be >= 0, got {max_imbalance}")
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        EngineReplica,
        name=DEPLOYMENT_NAME,
        num_replicas=replicas,
        # the engine queues what it cannot run yet: Ray's own back-pressure stays out of the way
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options=ray_actor_options or _replica_resources(spec),
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={
                "board": board, "policy": policy, "max_imbalance": max_imbalance,
            },
            request_routing_stats_period_s=STATS_PERIOD_S,
            request_routing_stats_timeout_s=5.0,
        ),
    )  # fmt: skip
    handle = serve.run(deployment.bind(spec), name=APP_NAME, route_prefix=None)
    log.info("replicas_deployed", replicas=replicas, policy=policy)
    return handle


def board_of(name: str = "loraplex") -> Board:
    """The routing board of this process (the router of a handle made here writes on it)."""
    return Board.named(name)


def undeploy() -> None:
    from ray import serve

    serve.delete(APP_NAME)
