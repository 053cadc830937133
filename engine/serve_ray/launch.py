"""``loraplex serve-ray``: ``loraplex serve`` over N engine replicas on Ray Serve.

Every ``loraplex serve`` flag keeps its meaning (``--host`` / ``--port``: the ingress); added:
``--replicas``, ``--ray-address`` (join a running cluster; default: start a local one on
127.0.0.1), the routing policy and its imbalance bound, the Ray dashboard and temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from typing import Any

from loraplex.engine.serve_ray.routing import POLICIES
from loraplex.engine.server import launch as serve_launch
from loraplex.engine.server.subcommand import Subcommand

__all__ = ["COMMAND", "add_arguments", "run", "serve_cluster"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_launch.add_arguments(p)
    g = p.add_argument_group("replicas on Ray Serve")
    g.add_argument("--replicas", type=_positive, default=2, metavar="N", help="engine replicas")
    g.add_argument(
        "--ray-address", metavar="ADDR",
        help="join the Ray cluster at ADDR (auto, HOST:PORT, ray://HOST:PORT); default: start "
        "a local one on 127.0.0.1",
    )  # fmt: skip
    g.add_argument(
        "--route-policy", choices=POLICIES, default="residency",
        help="residency: where the adapter is resident (GPU slot, then CPU tier), else the "
        "least-loaded replica; least_loaded / random ignore residency",
    )  # fmt: skip
    g.add_argument(
        "--route-max-imbalance", type=_non_negative, default=8, metavar="N",
        help="a replica holding the adapter loses its preference once it has N more requests "
        "(running + waiting) than the lightest replica: a hot adapter spreads",
    )  # fmt: skip
    g.add_argument(
        "--ray-dashboard", action="store_true", help="local cluster: start the Ray dashboard"
    )
    g.add_argument("--ray-temp-dir", metavar="DIR", help="local cluster: Ray's session folder")


async def serve_cluster(
    handle: Any,
    host: str,
    port: int,
    *,
    admin_token: str | None = None,
    metrics_top_k: int = 16,
    limits: Any = None,
    stop: asyncio.Event | None = None,
    ready: Any = None,
) -> None:
    """Run the ingress on ``handle``'s replicas until ``stop`` is set (default: SIGINT /
    SIGTERM); ``ready(url)`` is called once it listens."""
    from loraplex.engine.serve_ray.board import Board
    from loraplex.engine.serve_ray.cluster_engine import ClusterEngine
    from loraplex.engine.serve_ray.ingress import create_ingress_app

    async with ClusterEngine(handle, Board.named("loraplex")) as engine:
        app = create_ingress_app(
            engine, admin_token=admin_token, metrics_top_k=metrics_top_k, limits=limits
        )
        await serve_launch.serve_until_stopped(
            app, host, port, limits=limits, stop=stop, ready=ready, model=engine.model_name
        )


def run(args: argparse.Namespace) -> int:
    import structlog

    log = structlog.get_logger("loraplex.server")
    try:
        config, limits, token = serve_launch.settings_from_args(args)
        if config.lora_extra_vocab_size:  # the ingress encodes prompts with the base tokenizer
            raise ValueError("--lora-extra-vocab-size is not supported by serve-ray")
    except (ValueError, OSError) as e:
        log.error("bad_configuration", error=str(e))
        return 2
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        log.error(
            "missing_dependency",
            error="serve-ray needs Ray Serve: pip install -e '.[ray]' in a checkout",
        )
        return 2

    from loraplex.engine.serve_ray.cluster import LocalRay, deploy, undeploy
    from loraplex.engine.serve_ray.replica import ReplicaSpec

    spec = ReplicaSpec(config, tuple((m.name, m.uri, m.sha256) for m in args.lora_modules))
    try:
        if args.ray_address:
            cluster = LocalRay.join(args.ray_address)
        else:
            cpus = max(os.cpu_count() or 1, args.replicas)  # one CPU per CPU replica
            cluster = LocalRay.start(
                num_cpus=cpus, dashboard=args.ray_dashboard, temp_dir=args.ray_temp_dir
            )
    except Exception as e:  # noqa: BLE001 - one clear line, exit 1
        log.error("ray_failed", error=str(e), kind=type(e).__name__)
        return 1
    try:
        handle = deploy(
            spec,
            replicas=args.replicas,
            policy=args.route_policy,
            max_imbalance=args.route_max_imbalance,
        )
        asyncio.run(
            serve_cluster(
                handle, args.host, args.port, admin_token=token,
                metrics_top_k=args.metrics_top_k, limits=limits,
            )
        )  # fmt: skip
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - start-up failures: one clear line, exit 1
        log.error("serve_failed", error=str(e), kind=type(e).__name__)
        return 1
    finally:
        try:
            # a joined cluster lives on: take our app away. A local one goes away whole (and
            # Ctrl-C in a terminal reaches its processes too: no call to them may wait)
            if args.ray_address:
                with contextlib.suppress(Exception):  # nothing deployed, or Serve gone
                    undeploy()
        finally:
            cluster.stop()
    return 0


COMMAND = Subcommand(
    name="serve-ray",
    help="run the OpenAI-compatible server over N engine replicas on Ray Serve",
    description="Serve MODEL_DIR (default: the built-in demo model) with LoRA adapters on N "
    "engine replicas (Ray Serve), each request routed to a replica where its adapter is "
    "resident.",
    add_arguments=add_arguments,
    run=run,
)
