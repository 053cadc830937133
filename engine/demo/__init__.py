"""The built-in demo: a tiny Llama and a few LoRA adapters that ship inside the package.

Served when no model is given (``EngineConfig(model=None)``, ``loraplex serve`` without
MODEL_DIR). Nothing is downloaded; ``python -m loraplex.engine.demo.build`` regenerates the
assets. This module only locates files: it imports neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

__all__ = ["ASSETS_DIR", "demo_model_dir", "demo_adapters", "register_demo_adapters"]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
_HINT = "regenerate it with: python -m loraplex.engine.demo.build"


class _Engine(Protocol):  # an AsyncEngine (not imported: start-up imports this module)
    async def add_adapter(self, name: str, uri: str) -> Any: ...


def demo_model_dir() -> Path:
    """The folder of the demo base model (config.json, model.safetensors, tokenizer...)."""
    if not (ASSETS_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the demo model is missing from {ASSETS_DIR}; {_HINT}")
    return ASSETS_DIR


def demo_adapters() -> dict[str, Path]:
    """Demo adapter name -> its PEFT folder, sorted by name."""
    root = ASSETS_DIR / "adapters"
    if not root.is_dir():
        return {}
    return {
        p.name: p
        for p in sorted(root.iterdir())
        if p.is_dir() and (p / "adapter_config.json").is_file()
    }


async def register_demo_adapters(engine: _Engine) -> list[str]:
    """Register every demo adapter with ``engine`` under its name; returns the names."""
    names = []
    for name, path in demo_adapters().items():
        await engine.add_adapter(name, str(path))
        names.append(name)
    return names
