"""Local adapters: ``file:///abs/dir`` URIs and plain paths under operator roots.

The two files are copied into ``dest`` (aiofiles, chunked) rather than read in place: the
digest, the preflight and the tensor parse then all see one snapshot even if the operator
rewrites the source folder meanwhile, and every resolver hands the engine the same thing, a
private directory holding exactly the two files. The cost is one extra read+write of the
adapter, small next to a GPU load and only paid on a cold load.

Containment is checked on real paths: the directory and each adapter file must resolve under
a root, so ``..``, absolute paths elsewhere and symlinks (the directory or a file) pointing
out of the roots are refused. Files are opened with ``O_NOFOLLOW`` on the resolved path, so a
file swapped for a symlink after the check is refused too.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from loraplex.engine.lora.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterPolicyError,
)
from loraplex.plugins import hookimpl
from loraplex.resolvers.base import (
    ADAPTER_FILES,
    AdapterSource,
    Report,
    Resolver,
    ResolverSettings,
    copy_file,
)

__all__ = ["LocalResolver", "loraplex_resolvers"]


def _open_nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))


class _LocalSource(AdapterSource):
    def __init__(
        self, pinned_uri: str, files: dict[str, int | None], paths: dict[str, str], chunk: int
    ) -> None:
        self.pinned_uri, self.files, self._paths, self._chunk = pinned_uri, files, paths, chunk

    async def download(self, name: str, target: Path, report: Report) -> None:
        await copy_file(
            self._paths[name], target, report, chunk_bytes=self._chunk, opener=_open_nofollow
        )


class LocalResolver(Resolver):
    """Copies adapters from directories under ``settings.policy.local_roots``."""

    schemes = ("file",)

    async def open(self, uri: str) -> AdapterSource:
        return await asyncio.to_thread(self._scan, uri)

    def _scan(self, uri: str) -> _LocalSource:
        policy = self.settings.policy
        real = policy.local_path(uri)  # AdapterPolicyError outside the roots
        if not real.is_dir():
            raise AdapterNotFoundError(f"local adapter source {uri!r} is not a directory")
        files: dict[str, int | None] = {}
        paths: dict[str, str] = {}
        with os.scandir(real) as entries:
            for entry in entries:
                if entry.name not in ADAPTER_FILES:
                    files[entry.name] = None  # only its name matters (e.g. a .bin)
                    continue
                path = os.path.realpath(entry.path)
                if not policy.contains(path):
                    raise AdapterPolicyError(
                        f"{uri!r}: {entry.name} resolves to {path!r}, outside the allowed roots",
                        field=entry.name,
                    )
                st = os.stat(path)
                if not stat.S_ISREG(st.st_mode):
                    raise AdapterFormatError(
                        f"{uri!r}: {entry.name} is not a regular file", field=entry.name
                    )
                files[entry.name], paths[entry.name] = st.st_size, path
        return _LocalSource(real.as_uri(), files, paths, self.settings.chunk_bytes)


@hookimpl
def loraplex_resolvers(settings: ResolverSettings) -> list[Resolver]:
    return [LocalResolver(settings)]
