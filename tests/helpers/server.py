"""The real HTTP server on a tiny model, for the server tests (fixtures in
tests/server/conftest.py): ``Tiny`` (the model and its adapters, ``ADAPTER_SPECS``), ``BASE``
(its served name), ``engine_config``, ``serve`` (the server on a random local port) and
``Server`` (its URL, engine and an OpenAI client)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.server import create_app, start_server
from tests.helpers.models import ALL_MODULES

if TYPE_CHECKING:
    import openai


ADAPTER_SPECS = {
    "sql": dict(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    "poem": dict(r=8, alpha=16, target_modules=ALL_MODULES),
    "math": dict(r=6, alpha=24, target_modules=("gate_proj", "up_proj", "q_proj")),
}


BASE = "tiny-base"


@dataclass
class Tiny:
    model_dir: Path
    adapters: dict[str, Path]  # registered at start-up
    extra: Path  # an adapter for runtime (admin) loading, under ``extra_root``
    extra_root: Path


@dataclass
class Server:
    url: str
    engine: AsyncEngine

    def client(self) -> openai.AsyncOpenAI:
        import openai  # only where a test talks to the server (not on every machine)

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)


def engine_config(tiny: Tiny, **kw) -> EngineConfig:
    base = dict(
        model=str(tiny.model_dir),
        device="cpu",
        dtype="float32",
        served_model_name=BASE,
        max_loras=2,
        max_cpu_loras=3,
        max_lora_rank=16,
        block_size=4,
        kv_cache_bytes=8 << 20,
    )
    base.update(kw)
    return EngineConfig(**base)


async def serve(tiny: Tiny, *, admin_token: str | None = None, **kw) -> AsyncIterator[Server]:
    async with AsyncEngine(engine_config(tiny, **kw)) as engine:
        for name, path in tiny.adapters.items():
            await engine.add_adapter(name, f"file://{path}")
        runner, port = await start_server(create_app(engine, admin_token=admin_token))
        try:
            yield Server(f"http://127.0.0.1:{port}", engine)
        finally:
            await runner.cleanup()
