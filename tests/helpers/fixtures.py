"""A tiny Llama with a tokenizer and four adapters (``tiny``), and those adapters copied under a
test's tmp_path (``lib``): the fixtures of the engine and adapter-lifecycle tests (tests/engine/,
tests/adapters/). A pytest plugin, loaded by tests/conftest.py; a folder's conftest or a module
may define its own ``tiny`` (tests/server/ does), which then wins there."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.models import ALL_MODULES, make_peft_adapter, make_tiny_model
from tests.helpers.tokenizers import make_tokenizer

ADAPTER_SPECS = {
    "sql": dict(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    "poem": dict(r=8, alpha=16, target_modules=ALL_MODULES),
    "chat": dict(r=16, alpha=8, target_modules=r".*\.(k_proj|o_proj|down_proj)", use_rslora=True),
    "math": dict(r=6, alpha=24, target_modules=("gate_proj", "up_proj", "q_proj")),
}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("engine-model")
    model_dir = make_tiny_model(root / "base", kind="llama", seed=7)
    make_tokenizer(model_dir)
    adapters = {
        name: make_peft_adapter(model_dir, root / name, seed=100 + i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    return model_dir, adapters


@pytest.fixture
def lib(tiny, tmp_path) -> dict[str, Path]:
    """The tiny adapters copied under tmp_path (a local root of the engine)."""
    _, adapters = tiny
    out = {}
    for name, src in adapters.items():
        out[name] = Path(shutil.copytree(src, tmp_path / "lib" / name))
    return out
