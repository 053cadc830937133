"""A tiny model with three adapters, and the real HTTP server on a random local port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.server import create_app, start_server
from tests.helpers.models import ALL_MODULES, make_peft_adapter, make_tiny_model
from tests.helpers.tokenizers import make_tokenizer

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


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    root = tmp_path_factory.mktemp("server-model")
    model_dir = make_tiny_model(root / "base", kind="llama", seed=3)
    make_tokenizer(model_dir)
    adapters = {
        name: make_peft_adapter(model_dir, root / "adapters" / name, seed=200 + i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    extra = make_peft_adapter(model_dir, root / "dynamic" / "extra", seed=300, r=4, alpha=4)
    return Tiny(model_dir, adapters, extra, root / "dynamic")


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


@pytest.fixture
async def server(tiny) -> AsyncIterator[Server]:
    async for s in serve(tiny):
        yield s


@pytest.fixture(scope="session")
def hf(tiny):
    from tests.engine.hf_reference import HFReference

    return HFReference(tiny.model_dir, tiny.adapters)
