"""One local Ray cluster (127.0.0.1) per test session: 2 CPU replicas of the demo model, the
ingress on a local port, and a plain ``loraplex serve`` of the same flags to compare with.

The replicas have 4 adapter slots and 4 CPU-tier places each, and besides the demo adapters
two sets of 40 more (``a00``..``a39``, ``b00``..``b39``: the demo adapters' files under other
names), so the routing tests start from adapters no replica holds yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

pytest.importorskip("ray.serve")

from loraplex.engine.demo import demo_adapters  # noqa: E402
from loraplex.engine.server.cli import build_parser  # noqa: E402
from loraplex.engine.server.launch import config_from_args  # noqa: E402

T = TypeVar("T")
ADMIN_TOKEN = "serve-ray-admin-token"
SETS = ("a", "b")
PER_SET = 40
FLAGS = ["--device", "cpu", "--max-loras", "4", "--max-cpu-loras", "4", "--max-num-seqs", "8"]
PROMPT = "Once upon a time"


class LoopThread:
    """An event loop in a thread: the servers run there while the tests call in."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Cluster:
    loop: LoopThread
    handle: Any
    engine: Any  # ClusterEngine
    url: str  # the ingress
    reference_url: str  # loraplex serve, same flags
    gcs_address: str
    temp_dir: str  # the local cluster's session folder

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{url or self.url}/v1", api_key="x", max_retries=0, timeout=120
        )

    def replicas(self) -> list[str]:
        return sorted(self.engine.board.snapshot()[0])


def extra_modules() -> list[tuple[str, str, None]]:
    folders = list(demo_adapters().values())
    return [
        (f"{s}{i:02d}", str(folders[i % len(folders)]), None) for s in SETS for i in range(PER_SET)
    ]


def _wait(predicate, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


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
