"""A tiny model with three adapters, and the real HTTP server on a random local port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from tests.helpers.models import make_peft_adapter, make_tiny_model
from tests.helpers.server import ADAPTER_SPECS, Server, Tiny, serve
from tests.helpers.tokenizers import make_tokenizer

if TYPE_CHECKING:
    pass


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


@pytest.fixture
async def server(tiny) -> AsyncIterator[Server]:
    async for s in serve(tiny):
        yield s


@pytest.fixture(scope="session")
def hf(tiny):
    from tests.helpers.peft_oracle import HFReference

    return HFReference(tiny.model_dir, tiny.adapters)
