"""The sealed staging copy: why a re-load from the engine's own staging directory needs no
second trust decision (no second sha256).

A load verifies an adapter's bytes once: the pass (onepass.py) hashes what it reads and
compares DESIGN.md's digest before anything is usable. The staging copy it leaves is sealed at
that moment: both files are made read-only and their identity recorded in the version
(``AdapterVersion.seal``): the digest the pass verified, and per file its size, inode, device,
``mtime_ns`` and ``ctime_ns``. A later stage (the version evicted from the CPU tier and read
back) opens the files, checks the open descriptors against the seal before and after reading
them, and hashes nothing. Any write, truncate, chmod, rename over or ``utime`` of a sealed file
changes its ctime (which user space cannot set) or its inode, so a file that still matches is
the verified one; a mismatch raises ``StagedCopyChangedError`` and the engine fetches and
verifies the source again (the same digest or a typed AdapterDigestError).

What it assumes: the staging directory is the engine's own (``mkdtemp``, mode 0700), so no one
else writes a file between the pass's write and the seal (the same window as the pass's own
copy); timestamps have the filesystem's granularity (ext4, xfs, btrfs, tmpfs: a kernel tick or
finer; a change within the tick of the seal itself would go unseen). What it does not cover is
the value checks: a stage from the copy runs every header and value check again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from loraplex.engine.adapters.files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.engine.errors import StagedCopyChangedError

__all__ = ["FileSeal", "Seal", "seal_folder", "sealed_read"]

T = TypeVar("T")


@dataclass(frozen=True)
class FileSeal:
    size: int
    ino: int
    dev: int
    mtime_ns: int
    ctime_ns: int

    @staticmethod
    def of(st: os.stat_result) -> FileSeal:
        return FileSeal(st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Seal:
    """A verified staging copy: the digest its bytes had and each file's identity since."""

    digest: str
    config: FileSeal
    weights: FileSeal

    def check_fds(self, config_fd: int, weights_fd: int, where: str) -> None:
        """The open files are the sealed ones, unchanged (else StagedCopyChangedError)."""
        self._match(self.config, os.fstat(config_fd), CONFIG_FILE, where)
        self._match(self.weights, os.fstat(weights_fd), WEIGHTS_FILE, where)

    def check_folder(self, folder: Path) -> None:
        """The same by path (reads that open the files by name: full tables, DoRA's
        magnitudes, a combination's components)."""
        for name, want in ((CONFIG_FILE, self.config), (WEIGHTS_FILE, self.weights)):
            try:
                st = os.stat(folder / name)
            except FileNotFoundError:
                raise StagedCopyChangedError(
                    f"the staged copy's {name} is gone", field="sha256"
                ) from None
            self._match(want, st, name, str(folder))

    @staticmethod
    def _match(want: FileSeal, st: os.stat_result, name: str, where: str) -> None:
        got = FileSeal.of(st)
        if got != want:
            changed = [k for k in vars(want) if getattr(want, k) != getattr(got, k)]
            raise StagedCopyChangedError(
                f"the staged copy of {where!r} changed since it was verified ({name}: "
                f"{', '.join(changed)} differ): fetched and verified again",
                field="sha256",
            )


def seal_folder(folder: Path, digest: str) -> Seal:
    """Seal the two adapter files of a verified staging copy (read-only, identity recorded)."""
    files = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        path = folder / name
        os.chmod(path, 0o444)
        files.append(FileSeal.of(os.stat(path)))
    return Seal(digest, *files)


def sealed_read(seal: Seal | None, folder: Path, read: Callable[[], T]) -> T:
    """``read()`` (which opens files of ``folder`` by name), with the seal checked before and
    after it: what it read is the verified copy. No seal: ``read()`` alone."""
    if seal is None:
        return read()
    seal.check_folder(folder)
    out = read()
    seal.check_folder(folder)
    return out
