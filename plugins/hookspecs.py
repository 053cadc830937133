"""Hook specifications of the ``loraplex`` plugin system.

Hooks are synchronous (pluggy does not await): they return objects, and the engine awaits the
async methods of the resolvers they return. Implement them in a module or class with
``@loraplex.plugins.hookimpl`` and register it through the ``loraplex.plugins`` entry-point
group (the built-in resolvers are registered the same way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from loraplex.resolvers.base import Resolver, ResolverSettings

__all__ = ["PROJECT_NAME", "ENTRY_POINT_GROUP", "hookspec", "hookimpl"]

PROJECT_NAME = "loraplex"
ENTRY_POINT_GROUP = "loraplex.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def loraplex_resolvers(settings: ResolverSettings) -> list[Resolver]:  # type: ignore[empty-body]
    """Return the resolvers this plugin provides, built with the operator's ``settings``.

    Each resolver declares the URI schemes it handles in ``Resolver.schemes``; two resolvers
    claiming one scheme is a configuration error. Called once per plugin manager, lazily.
    """


@hookspec(firstresult=True)
def loraplex_resolve_adapter_name(  # type: ignore[empty-body]
    name: str, settings: ResolverSettings
) -> str | None:
    """Map an adapter ``name`` the engine does not know to a source URI, or return None.

    Used for dynamic loading (e.g. a plugin that maps names to a bucket). The first non-None
    answer wins. The engine still checks the URI against the operator's source policy before
    fetching it, so a plugin cannot widen what may be loaded. Must be cheap: no I/O.
    """
