"""The demo model behind the real HTTP server, shared by a module's tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest_asyncio

from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.demo import register_demo_adapters
from loraplex.engine.server import create_app, start_server
from tests.helpers.server import Server

if TYPE_CHECKING:  # openai is imported by the server tests only: the bitmask tests run
    import openai  # where it is not installed


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def demo_server():
    async with AsyncEngine(EngineConfig(device="cpu", max_num_seqs=64)) as engine:
        await register_demo_adapters(engine)
        runner, port = await start_server(create_app(engine))
        try:
            yield Server(f"http://127.0.0.1:{port}", engine)
        finally:
            await runner.cleanup()


def client(server: Server) -> openai.AsyncOpenAI:
    return server.client()
