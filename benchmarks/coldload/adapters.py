"""Re-exports ``loraplex.engine.bench.coldload.adapters`` (benchmarks import ``TINY`` here)."""

from __future__ import annotations

from loraplex.engine.bench.coldload.adapters import (
    TINY,
    AdapterSet,
    adapter_names,
    build_model,
    model_config,
    resolve_device,
    write_adapter_set,
)

__all__ = [
    "TINY",
    "AdapterSet",
    "adapter_names",
    "build_model",
    "model_config",
    "resolve_device",
    "write_adapter_set",
]
