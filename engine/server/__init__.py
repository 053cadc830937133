"""OpenAI-compatible HTTP server (aiohttp) and the ``loraplex`` command line.

Names are imported lazily so that ``loraplex --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.server.app import create_app, create_app_from_config
    from loraplex.engine.server.launch import LoraModule, start_server

__all__ = ["LoraModule", "create_app", "create_app_from_config", "start_server"]

_WHERE = {
    "create_app": "loraplex.engine.server.app",
    "create_app_from_config": "loraplex.engine.server.app",
    "LoraModule": "loraplex.engine.server.launch",
    "start_server": "loraplex.engine.server.launch",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'loraplex.engine.server' has no attribute {name!r}")
