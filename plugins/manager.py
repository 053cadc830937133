"""Loads plugins from the ``loraplex.plugins`` entry-point group and calls their hooks.

The host never calls hooks directly: it uses the typed wrappers ``resolver_for`` and
``resolve_name`` with keyword arguments, or ``fetch_adapter`` (policy check, the URI's
resolver, fetch). The resolver contract (``loraplex.resolvers.base``, ``.policy``) sits below
this module: it never imports the plugin system.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import pluggy

from loraplex.engine.errors import AdapterSourceError
from loraplex.plugins import hookspecs
from loraplex.plugins.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME
from loraplex.resolvers.base import FetchResult, ProgressCallback, Resolver, ResolverSettings
from loraplex.resolvers.policy import SourcePolicy, scheme_of

__all__ = ["BUILTIN_PLUGINS", "PluginLoadError", "PluginManager", "fetch_adapter"]

BUILTIN_PLUGINS = ("local", "huggingface", "s3")


class PluginLoadError(RuntimeError):
    """A plugin named in the configuration is missing, fails to import or misbehaves."""


class PluginManager:
    """Plugins enabled by entry-point name (``None``: the built-in resolvers only)."""

    def __init__(
        self,
        enabled: Sequence[str] | None = None,
        settings: ResolverSettings | None = None,
        *,
        group: str = ENTRY_POINT_GROUP,
    ) -> None:
        self.settings = settings or ResolverSettings()
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._by_scheme: dict[str, Resolver] | None = None
        names = BUILTIN_PLUGINS if enabled is None else tuple(enabled)
        available = _entry_points(group)
        missing = [n for n in names if n not in available]
        if missing:
            raise PluginLoadError(
                f"plugins {', '.join(missing)} are not installed in entry-point group {group!r} "
                f"(installed: {', '.join(sorted(available)) or 'none'})"
            )
        for name in dict.fromkeys(names):
            try:
                plugin = available[name].load()
            except Exception as e:
                raise PluginLoadError(f"plugin {name!r} failed to load: {e}") from e
            self.register(plugin, name)

    @property
    def plugin_names(self) -> list[str]:
        """Names of the registered plugins."""
        return [n for n, _ in self._pm.list_name_plugin()]

    def register(self, plugin: Any, name: str) -> None:
        """Register an in-process plugin (a module or object with ``@hookimpl`` methods)."""
        try:
            self._pm.register(plugin, name=name)
            self._pm.check_pending()
        except (ValueError, pluggy.PluginValidationError) as e:
            if self._pm.has_plugin(name):
                self._pm.unregister(name=name)
            raise PluginLoadError(f"plugin {name!r} cannot be registered: {e}") from e
        self._by_scheme = None

    def update_settings(self, settings: ResolverSettings) -> None:
        """Replace the settings (e.g. a policy that allows a new static source); resolvers are
        rebuilt with them on next use."""
        self.settings = settings
        self._by_scheme = None

    def unregister(self, name: str) -> None:
        self._pm.unregister(name=name)
        self._by_scheme = None

    def resolvers(self) -> dict[str, Resolver]:
        """Scheme -> resolver over all plugins; built on first use with ``settings``."""
        if self._by_scheme is None:
            by_scheme: dict[str, Resolver] = {}
            for batch in self._pm.hook.loraplex_resolvers(settings=self.settings):
                for resolver in batch or ():
                    if not isinstance(resolver, Resolver):
                        raise PluginLoadError(
                            f"loraplex_resolvers returned {resolver!r}, which is not a Resolver"
                        )
                    for scheme in resolver.schemes:
                        other = by_scheme.setdefault(scheme.lower(), resolver)
                        if other is not resolver:
                            raise PluginLoadError(
                                f"URI scheme {scheme!r} is claimed by both {type(other).__name__} "
                                f"and {type(resolver).__name__}"
                            )
            self._by_scheme = by_scheme
        return dict(self._by_scheme)

    def resolver_for(self, uri: str) -> Resolver:
        """The resolver for ``uri``'s scheme; AdapterSourceError if no plugin handles it."""
        scheme = scheme_of(uri)
        resolver = self.resolvers().get(scheme)
        if resolver is None:
            known = ", ".join(sorted(self.resolvers())) or "none"
            raise AdapterSourceError(
                f"no resolver for URI scheme {scheme!r} of {uri!r} (enabled: {known})",
                field="uri",
            )
        return resolver

    def resolve_name(self, name: str) -> str | None:
        """A source URI for an unknown adapter ``name`` from the first plugin that knows it."""
        uri = self._pm.hook.loraplex_resolve_adapter_name(name=name, settings=self.settings)
        if uri is not None and not isinstance(uri, str):
            raise PluginLoadError(f"loraplex_resolve_adapter_name returned {uri!r}, not a str")
        return uri


async def fetch_adapter(
    uri: str,
    dest: Path,
    *,
    manager: PluginManager,
    policy: SourcePolicy | None = None,
    progress: ProgressCallback | None = None,
    max_bytes: int | None = None,
) -> FetchResult:
    """Check ``uri`` against ``policy`` (default: the manager's), pick its resolver, fetch."""
    policy = policy if policy is not None else manager.settings.policy
    await asyncio.to_thread(policy.check, uri)
    resolver = manager.resolver_for(uri)
    return await resolver.fetch(uri, dest, progress, max_bytes=max_bytes)


def _entry_points(group: str) -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        found.setdefault(ep.name, ep)  # the same distribution can be visible twice
    return found
