"""The local Ray cluster of the serve_ray tests (its fixture is tests/serve_ray/conftest.py's):
``Cluster`` (the ingress, the replicas and a plain ``loraplex serve`` of the same ``FLAGS``),
``LoopThread`` (the servers' event loop), ``wait_for``, the adapter sets (``SETS`` of
``PER_SET`` names, ``extra_modules``) and the admin token."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import openai

from loraplex.engine.demo import demo_adapters  # noqa: E402

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


def wait_for(predicate, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
