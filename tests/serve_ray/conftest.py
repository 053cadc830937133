"""One local Ray cluster (127.0.0.1) per test session: 2 CPU replicas of the demo model, the
ingress on a local port, and a plain ``loraplex serve`` of the same flags to compare with.

The replicas have 4 adapter slots and 4 CPU-tier places each, and besides the demo adapters
two sets of 40 more (``a00``..``a39``, ``b00``..``b39``: the demo adapters' files under other
names), so the routing tests start from adapters no replica holds yet.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from loraplex.engine.demo import demo_adapters  # noqa: E402
from loraplex.engine.server.cli import build_parser  # noqa: E402
from loraplex.engine.server.launch import config_from_args  # noqa: E402
from tests.helpers.ray_cluster import (
    ADMIN_TOKEN,
    FLAGS,
    Cluster,
    LoopThread,
    extra_modules,
)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    import ray

    from loraplex.engine.serve_ray.cluster import LocalRay, board_of, deploy, undeploy
    from loraplex.engine.serve_ray.cluster_engine import ClusterEngine
    from loraplex.engine.serve_ray.ingress import create_ingress_app
    from loraplex.engine.serve_ray.replica import ReplicaSpec
    from loraplex.engine.server.app import create_app_from_config
    from loraplex.engine.server.launch import LoraModule, start_server

    root = str(next(iter(demo_adapters().values())).parent)
    args = build_parser().parse_args(["serve", *FLAGS, "--lora-local-root", root])
    config = config_from_args(args)
    ray_cluster = LocalRay.start(num_cpus=2)
    loop = LoopThread()
    runners = []
    try:
        handle = deploy(ReplicaSpec(config, tuple(extra_modules())), replicas=2)

        async def start() -> tuple[Any, str, str]:
            engine = ClusterEngine(handle, board_of())
            await engine.start()
            for _ in range(200):  # both replicas have reported their residency
                if len(engine.board.snapshot()[0]) == 2:
                    break
                await asyncio.sleep(0.1)
            ingress = create_ingress_app(engine, admin_token=ADMIN_TOKEN)
            runner, port = await start_server(ingress, "127.0.0.1", 0)
            runners.append(runner)
            modules = [LoraModule(*m) for m in extra_modules()]
            reference = create_app_from_config(
                config, admin_token=ADMIN_TOKEN, lora_modules=modules
            )
            ref_runner, ref_port = await start_server(reference, "127.0.0.1", 0)
            runners.append(ref_runner)
            return engine, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ref_port}"

        engine, url, reference_url = loop.run(start())
        gcs = ray.get_runtime_context().gcs_address
        yield Cluster(loop, handle, engine, url, reference_url, gcs, str(ray_cluster.temp_dir))

        async def stop() -> None:
            for r in runners:
                await r.cleanup()
            await engine.close()

        loop.run(stop(), timeout=60)
    finally:
        loop.stop()
        with contextlib.suppress(Exception):  # the CLI test may have taken the app over
            undeploy()
        ray_cluster.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_cluster.py ends by killing a replica and handing the app to the CLI: its tests run
    after every other test of the session's cluster, whatever order the files came in."""
    last = Path(__file__).with_name("test_cluster.py")
    ours = [item for item in items if item.path == last]
    rest = [item for item in items if item.path != last]
    users = [k for k, item in enumerate(rest) if "cluster" in getattr(item, "fixturenames", ())]
    if ours and users:
        items[:] = rest[: users[-1] + 1] + ours + rest[users[-1] + 1 :]
