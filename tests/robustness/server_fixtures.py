"""The demo model behind the real HTTP server, for the hostile-request tests (CPU, loopback)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.demo import register_demo_adapters
from loraplex.engine.server import create_app, start_server
from loraplex.engine.server.limits import ServerLimits

BASE = "demo"
ADMIN = "s3cret-admin"


@dataclass
class DemoServer:
    url: str
    engine: AsyncEngine
    runner: Any
    adapters: list[str]

    async def post(
        self, path: str, body: bytes | dict, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """Status and parsed JSON (``None`` when the reply is not JSON)."""
        kw: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"data": body}
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{self.url}{path}", headers=headers, **kw) as r,
        ):
            raw = await r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, None


def demo_config(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        model=None, device="cpu", served_model_name=BASE, max_loras=2, max_cpu_loras=4
    )
    base.update(kw)
    return EngineConfig(**base)


async def serve_demo(
    limits: ServerLimits | None = None, admin_token: str | None = ADMIN, **config: Any
) -> AsyncIterator[DemoServer]:
    async with AsyncEngine(demo_config(**config)) as engine:
        names = await register_demo_adapters(engine)
        app = create_app(engine, admin_token=admin_token, limits=limits)
        runner, port = await start_server(app, limits=limits)
        try:
            yield DemoServer(f"http://127.0.0.1:{port}", engine, runner, names)
        finally:
            await runner.cleanup()


def assert_error(body: Any, status: int, *, param: Any = ..., says: str | None = None) -> None:
    """The OpenAI / vLLM error shape with ``status`` (and the offending param / words)."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"], err
    if param is not ...:
        assert err["param"] == param, err
    if says is not None:
        assert says in err["message"], err


async def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> dict:
    """Poll until nothing runs and no KV block or adapter reference is held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        s = engine.stats()
        refs = s["adapter_refs"].values()
        idle = s["running"] == 0 and s["waiting"] == 0 and s["num_used_blocks"] == 0
        if idle and all(r["users"] == 0 and r["slot_refs"] == 0 for r in refs):
            return s
        assert loop.time() < deadline, s
        await asyncio.sleep(0.05)


GREEDY = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


async def greedy_text(server: DemoServer, model: str = BASE) -> str:
    status, body = await server.post("/v1/completions", {**GREEDY, "model": model})
    assert status == 200, body
    return body["choices"][0]["text"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)
