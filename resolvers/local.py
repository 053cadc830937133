"""Local adapters: ``file:///abs/dir`` URIs and plain paths under operator roots.

The two files are copied into ``dest`` (aiofiles, chunked) rather than read in place: the
digest, the preflight and the tensor parse then all see one snapshot even if the operator
rewrites the source folder meanwhile, and every resolver hands the engine the same thing, a
private directory holding exactly the two files. The cost is one extra read+write of the
adapter, small next to a GPU load and only paid on a cold load.

Containment: the policy checks the real path (``..``, absolute paths elsewhere and symlinks
pointing out of the roots are refused). That check alone is a check-then-use race: a
directory swapped for a symlink to an outside folder after it would be followed by a later
open. So the scan opens the root once and walks every component of the checked real path from
it with ``O_NOFOLLOW | O_DIRECTORY`` (``openat`` per component), lists and stats the adapter
folder through that descriptor, and opens each adapter file ``O_NOFOLLOW`` relative to it. The
download reads only those already-open file descriptors, never a path. A component swapped
for a symlink during the walk fails with AdapterPolicyError; a swap after it is not seen at all
(the open descriptors still name the checked files). An adapter file that is itself a symlink
(e.g. a Hugging Face cache snapshot pointing into ``blobs/``) is followed only if its real path
lies under a root, and is then opened by the same no-follow walk.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from loraplex.engine.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterPolicyError,
    AdapterSourceError,
    LoRAError,
)
from loraplex.plugins import hookimpl
from loraplex.resolvers.base import (
    ADAPTER_FILES,
    TOKENIZER_FILES,
    AdapterSource,
    Report,
    Resolver,
    ResolverSettings,
    copy_file,
)
from loraplex.resolvers.policy import SourcePolicy

__all__ = ["LocalResolver", "loraplex_resolvers"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC
# NOTE: O_NONBLOCK so that a FIFO planted under a root cannot block the open; the fstat after
# the open refuses anything that is not a regular file
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)


def _swapped(uri: str, where: str) -> AdapterPolicyError:
    return AdapterPolicyError(
        f"local adapter source {uri!r}: {where} is a symbolic link now (it changed while the "
        "adapter was being loaded); refused",
        field="uri",
    )


def _open_beneath(policy: SourcePolicy, real: str, uri: str, *, leaf_dir: bool) -> int:
    """Open ``real`` (a checked real path under a root) without following any symlink below
    the root: each component is opened relative to its parent's descriptor."""
    root = policy.root_of(real)
    if root is None:
        raise AdapterPolicyError(f"local adapter source {uri!r} is outside the allowed roots")
    parts = Path(real).relative_to(root).parts
    try:
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    except OSError as e:
        raise AdapterSourceError(f"local root {root!r} cannot be opened: {e}", field="uri") from e
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            flags = _DIR_FLAGS if leaf_dir or not last else _FILE_FLAGS
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except OSError as e:
                raise _walk_error(fd, name, os.path.join(root, *parts[: i + 1]), uri, e) from e
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk_error(parent: int, name: str, path: str, uri: str, e: OSError) -> Exception:
    if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            return AdapterNotFoundError(f"local adapter source {uri!r}: {path!r} does not exist")
        if stat.S_ISLNK(st.st_mode):
            return _swapped(uri, repr(path))
        if e.errno != errno.ENOENT and not stat.S_ISDIR(st.st_mode):
            return AdapterNotFoundError(
                f"local adapter source {uri!r}: {path!r} is not a directory"
            )
    # e.g. a link that is a directory again by now: the path changed under the load
    return AdapterSourceError(
        f"local adapter source {uri!r}: cannot open {path!r} ({e}); did it change while the "
        "adapter was being loaded?",
        field="uri",
    )


class _LocalSource(AdapterSource):
    """Holds the adapter files open; downloads read those descriptors, never a path."""

    def __init__(
        self, pinned_uri: str, files: dict[str, int | None], fds: dict[str, int], chunk: int
    ) -> None:
        self.pinned_uri, self.files, self._fds, self._chunk = pinned_uri, files, fds, chunk

    async def download(self, name: str, target: Path, report: Report) -> None:
        fd = self._fds[name]

        def opener(_path: str, _flags: int) -> int:
            dup = os.dup(fd)
            os.lseek(dup, 0, os.SEEK_SET)
            return dup

        await copy_file(name, target, report, chunk_bytes=self._chunk, opener=opener)

    async def aclose(self) -> None:
        self.close()

    def local_fd(self, name: str) -> int | None:
        fd = self._fds.get(name)
        return None if fd is None else os.dup(fd)  # read with pread: offsets are shared

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        _close_all(fds.values())


class LocalResolver(Resolver):
    """Copies adapters from directories under ``settings.policy.local_roots``."""

    schemes = ("file",)

    async def open(self, uri: str) -> AdapterSource:
        scan = asyncio.ensure_future(asyncio.to_thread(self._scan, uri))
        try:
            return await asyncio.shield(scan)
        except asyncio.CancelledError:
            # the thread runs on: close the descriptors it opens once it is done
            scan.add_done_callback(_close_result)
            raise

    def _scan(self, uri: str) -> _LocalSource:
        policy = self.settings.policy
        real = str(policy.local_path(uri))  # AdapterPolicyError outside the roots
        dfd = _open_beneath(policy, real, uri, leaf_dir=True)
        files: dict[str, int | None] = {}
        fds: dict[str, int] = {}
        try:
            for name in sorted(os.listdir(dfd)):
                if name in TOKENIZER_FILES:  # optional (fetch's extra_files): skipped if odd
                    with contextlib.suppress(LoRAError, OSError):
                        fd = self._open_file(policy, dfd, real, name, uri)
                        fds[name] = fd
                        if stat.S_ISREG(os.fstat(fd).st_mode):
                            files[name] = os.fstat(fd).st_size
                    continue
                if name not in ADAPTER_FILES:
                    files[name] = None  # only its name matters (e.g. a .bin)
                    continue
                fds[name] = self._open_file(policy, dfd, real, name, uri)
                st = os.fstat(fds[name])
                if not stat.S_ISREG(st.st_mode):
                    raise AdapterFormatError(f"{uri!r}: {name} is not a regular file", field=name)
                files[name] = st.st_size
        except BaseException:
            _close_all(fds.values())
            raise
        finally:
            os.close(dfd)
        return _LocalSource(Path(real).as_uri(), files, fds, self.settings.chunk_bytes)

    @staticmethod
    def _open_file(policy: SourcePolicy, dfd: int, real_dir: str, name: str, uri: str) -> int:
        try:
            return os.open(name, _FILE_FLAGS, dir_fd=dfd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EMLINK):  # EMLINK: O_NOFOLLOW on FreeBSD
                if e.errno == errno.ENOENT:
                    raise AdapterSourceError(
                        f"{uri!r}: {name} disappeared while the adapter was being loaded",
                        field=name,
                    ) from e
                raise AdapterSourceError(f"{uri!r}: cannot open {name}: {e}", field=name) from e
        # a symlinked adapter file: allowed if its real path lies under a root
        target = policy.real_path(os.path.join(real_dir, name))
        if not policy.contains_real(target):
            raise AdapterPolicyError(
                f"{uri!r}: {name} resolves to {target!r}, outside the allowed roots", field=name
            )
        return _open_beneath(policy, target, uri, leaf_dir=False)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_result(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


@hookimpl
def loraplex_resolvers(settings: ResolverSettings) -> list[Resolver]:
    return [LocalResolver(settings)]
