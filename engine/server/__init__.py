"""OpenAI-compatible HTTP server (aiohttp) and the ``loraplex`` command line."""

from __future__ import annotations

from loraplex.engine.server.app import create_app, create_app_from_config
from loraplex.engine.server.launch import LoraModule, start_server

__all__ = ["LoraModule", "create_app", "create_app_from_config", "start_server"]
