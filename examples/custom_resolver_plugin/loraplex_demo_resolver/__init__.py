"""Example loraplex plugin: ``demo://<name>`` serves adapters from one configured folder.

Configure the folder with ``ResolverSettings(options={"demo": {"root": ...}})`` or the
``LORAPLEX_DEMO_ROOT`` environment variable. Hooks are synchronous and cheap; the resolver's
async methods do the I/O.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from loraplex.plugins import hookimpl
from loraplex.resolvers import (
    AdapterNotFoundError,
    AdapterSource,
    AdapterSourceError,
    Report,
    Resolver,
    ResolverSettings,
    copy_file,
)

__all__ = ["DemoResolver", "demo_root", "loraplex_resolvers", "loraplex_resolve_adapter_name"]

SCHEME = "demo"
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")  # one path component, never "." or ".."


def demo_root(settings: ResolverSettings) -> Path | None:
    """The configured adapter folder, or None."""
    root = settings.options.get(SCHEME, {}).get("root") or os.environ.get("LORAPLEX_DEMO_ROOT")
    return Path(root) if root else None


class _FolderSource(AdapterSource):
    def __init__(self, pinned_uri: str, folder: Path, files: dict[str, int | None]) -> None:
        self.pinned_uri, self.folder, self.files = pinned_uri, folder, files

    async def download(self, name: str, target: Path, report: Report) -> None:
        await copy_file(self.folder / name, target, report)


def _list(folder: Path) -> dict[str, int | None]:
    if not folder.is_dir():
        raise AdapterNotFoundError(f"demo adapter folder {str(folder)!r} does not exist")
    with os.scandir(folder) as entries:  # symlinks are not followed, so cannot escape the root
        return {e.name: e.stat().st_size for e in entries if e.is_file(follow_symlinks=False)}


class DemoResolver(Resolver):
    """Serves ``demo://<name>`` from ``<root>/<name>``."""

    schemes = (SCHEME,)

    async def open(self, uri: str) -> AdapterSource:
        name = uri[len(f"{SCHEME}://") :]
        if not _NAME.fullmatch(name):
            raise AdapterSourceError(f"{uri!r}: the name must match {_NAME.pattern}", field="uri")
        root = demo_root(self.settings)
        if root is None:
            raise AdapterSourceError("demo resolver: no root configured", field="root")
        files = await asyncio.to_thread(_list, root / name)
        return _FolderSource(f"{SCHEME}://{name}", root / name, files)


@hookimpl
def loraplex_resolvers(settings: ResolverSettings) -> list[Resolver]:
    return [DemoResolver(settings)]


@hookimpl
def loraplex_resolve_adapter_name(name: str, settings: ResolverSettings) -> str | None:
    # Cheap and I/O-free: a missing folder surfaces as AdapterNotFoundError at fetch time.
    if demo_root(settings) is not None and _NAME.fullmatch(name):
        return f"{SCHEME}://{name}"
    return None
