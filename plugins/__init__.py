"""The plugin system: pluggy markers, hook specifications and the plugin manager."""

from __future__ import annotations

from loraplex.plugins.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec
from loraplex.plugins.manager import BUILTIN_PLUGINS, PluginLoadError, PluginManager

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "PluginLoadError",
    "PluginManager",
    "hookimpl",
    "hookspec",
]
