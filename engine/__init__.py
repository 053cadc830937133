"""loraplex engine: one frozen base model, many LoRA adapters per continuous batch.

The public names are imported lazily so that ``import loraplex.engine.model.lora.ops`` (and the
like) does not pull in the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.async_engine import AsyncEngine
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.request import RequestOutput
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.structured import StructuredOutput

__all__ = ["AsyncEngine", "EngineConfig", "SamplingParams", "RequestOutput", "StructuredOutput"]

_WHERE = {
    "AsyncEngine": "loraplex.engine.async_engine",
    "EngineConfig": "loraplex.engine.config",
    "RequestOutput": "loraplex.engine.request",
    "SamplingParams": "loraplex.engine.sampling_params",
    "StructuredOutput": "loraplex.engine.structured",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loraplex.engine' has no attribute {name!r}")
