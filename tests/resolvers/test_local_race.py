"""The local resolver under a path that changes while it loads: a directory inside a root
swapped for a symlink to an outside folder must never hand over the outside adapter, and every
failure is a typed LoRAError (a 4xx at the admin route), never a raw OSError."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path

import pytest

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.errors import AdapterPolicyError, AdapterSourceError, LoRAError
from loraplex.resolvers import ResolverSettings, SourcePolicy
from loraplex.resolvers.base import AdapterSource
from loraplex.resolvers.local import LocalResolver
from tests.resolvers.tiny_adapter import write_adapter


def _swap_for_link(path: Path, target: Path) -> None:
    """Replace directory ``path`` by a symlink to ``target`` (the directory moves aside)."""
    path.rename(path.with_name(path.name + ".moved"))
    path.symlink_to(target, target_is_directory=True)


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(root, inside adapter at root/team/a, outside adapter with different content)."""
    root = tmp_path / "root"
    inside = write_adapter(root / "team" / "a", seed=0)
    outside = write_adapter(tmp_path / "outside" / "team" / "a", seed=1)
    assert adapter_digest(inside) != adapter_digest(outside)
    return root, inside, outside


class _SwapAfterOpen(LocalResolver):
    """Swaps a directory for a symlink right after the scan: the window between the check and
    the reads that the old resolver left open (it opened the files again by path)."""

    def __init__(self, settings: ResolverSettings, path: Path, target: Path) -> None:
        super().__init__(settings)
        self.path, self.target = path, target

    async def open(self, uri: str) -> AdapterSource:
        source = await super().open(uri)
        _swap_for_link(self.path, self.target)
        return source


@pytest.mark.parametrize("component", ["adapter dir", "parent dir"])
async def test_swap_after_the_scan_never_reads_outside(
    layout: tuple[Path, Path, Path], tmp_path: Path, component: str
) -> None:
    root, inside, outside = layout
    want = adapter_digest(inside)
    swap, target = (
        (inside, outside) if component == "adapter dir" else (inside.parent, outside.parent)
    )
    settings = ResolverSettings(policy=SourcePolicy(local_roots=[root]))
    dest = tmp_path / "dest"
    try:
        await _SwapAfterOpen(settings, swap, target).fetch(str(inside), dest)
    except LoRAError:
        return  # a typed refusal is fine too
    assert adapter_digest(dest) == want  # the files that were checked, not the outside ones


class _SwapAfterCheck(SourcePolicy):
    """A policy whose real-path check is followed at once by a swap: the walk that follows
    must meet the symlink and refuse it."""

    def __init__(self, root: Path, path: Path, target: Path) -> None:
        super().__init__(local_roots=(str(root),))
        object.__setattr__(self, "swap", (path, target))

    def local_path(self, uri: str) -> Path:
        real = super().local_path(uri)
        path, target = self.swap  # type: ignore[attr-defined]
        if not path.is_symlink():
            _swap_for_link(path, target)
        return real


@pytest.mark.parametrize("component", ["adapter dir", "parent dir"])
async def test_swap_between_check_and_walk_is_refused(
    layout: tuple[Path, Path, Path], tmp_path: Path, component: str
) -> None:
    root, inside, outside = layout
    swap, target = (
        (inside, outside) if component == "adapter dir" else (inside.parent, outside.parent)
    )
    resolver = LocalResolver(ResolverSettings(policy=_SwapAfterCheck(root, swap, target)))
    with pytest.raises(AdapterPolicyError, match="symbolic link now"):
        await resolver.open(str(inside))


async def test_realpath_failing_midway_is_a_typed_error(
    layout: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``os.path.realpath`` raises EINVAL when a link it lstat'ed is a directory again by the
    time it calls readlink; that was an unhandled OSError (a 500 at the admin route)."""
    root, inside, _ = layout
    settings = ResolverSettings(policy=SourcePolicy(local_roots=[root]))

    def racing_realpath(path: object, **kw: object) -> str:
        raise OSError(errno.EINVAL, "Invalid argument", str(path))

    monkeypatch.setattr(os.path, "realpath", racing_realpath)
    with pytest.raises(AdapterSourceError, match="changed while it was being resolved"):
        await LocalResolver(settings).fetch(str(inside), tmp_path / "dest")


def _renameat2_exchange():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return None
    at_fdcwd, rename_exchange = -100, 2

    def exchange(a: Path, b: Path) -> None:
        if fn(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    return exchange


async def test_swapping_thread_never_leaks_the_outside_adapter(
    layout: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A bounded loop of fetches while another thread atomically exchanges the adapter
    directory with a symlink to an outside adapter (renameat2 RENAME_EXCHANGE)."""
    exchange = _renameat2_exchange()
    if exchange is None:
        pytest.skip("renameat2 is not available")
    root, inside, outside = layout
    want, bad = adapter_digest(inside), adapter_digest(outside)
    link = inside.with_name("a.link")
    link.symlink_to(outside, target_is_directory=True)
    try:
        exchange(inside, link)
        exchange(inside, link)
    except OSError as e:
        pytest.skip(f"RENAME_EXCHANGE is not supported here: {e}")
    settings = ResolverSettings(policy=SourcePolicy(local_roots=[root]))
    stop = threading.Event()

    def swapper() -> None:
        while not stop.is_set():
            exchange(inside, link)

    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    outcomes: dict[str, int] = {}
    try:
        for i in range(150):
            dest = tmp_path / f"dest{i}"
            try:
                await LocalResolver(settings).fetch(str(inside), dest)
            except LoRAError as e:
                outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
                continue
            got = adapter_digest(dest)
            assert got != bad, f"fetch {i} returned the outside adapter"
            assert got == want
            outcomes["ok"] = outcomes.get("ok", 0) + 1
    finally:
        stop.set()
        thread.join()


async def test_descriptors_are_closed(layout: tuple[Path, Path, Path], tmp_path: Path) -> None:
    root, inside, outside = layout
    settings = ResolverSettings(policy=SourcePolicy(local_roots=[root]))
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        pytest.skip("no /proc/self/fd")
    before = len(list(fd_dir.iterdir()))
    for i in range(5):
        await LocalResolver(settings).fetch(str(inside), tmp_path / f"ok{i}")
        with pytest.raises(LoRAError):
            await LocalResolver(settings).fetch(str(root / "nope"), tmp_path / f"bad{i}")
    (inside / "adapter_model.safetensors").unlink()
    (inside / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(AdapterPolicyError):
        await LocalResolver(settings).fetch(str(inside), tmp_path / "escape")
    assert len(list(fd_dir.iterdir())) == before


async def test_fifo_is_refused_without_blocking(
    layout: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    root, inside, _ = layout
    (inside / "adapter_model.safetensors").unlink()
    os.mkfifo(inside / "adapter_model.safetensors")
    settings = ResolverSettings(policy=SourcePolicy(local_roots=[root]))
    with pytest.raises(LoRAError, match="not a regular file"):
        await LocalResolver(settings).fetch(str(inside), tmp_path / "dest")


async def test_symlinked_file_inside_the_roots_is_followed(
    layout: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A snapshot folder whose files link into a blob store under the same root (the layout
    of a Hugging Face cache) still loads."""
    root, inside, _ = layout
    blobs = root / "blobs"
    blobs.mkdir()
    snap = root / "snapshots" / "abc"
    snap.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (inside / name).rename(blobs / name)
        (snap / name).symlink_to(Path("../..") / "blobs" / name)
    settings = ResolverSettings(policy=SourcePolicy(local_roots=[root]))
    dest = tmp_path / "dest"
    await LocalResolver(settings).fetch(str(snap), dest)
    assert adapter_digest(dest) == adapter_digest(blobs)


@pytest.mark.parametrize("path", ["{root}/\ud800", "file://{root}/a\ud800b"])
async def test_unencodable_path_is_a_typed_refusal(
    layout: tuple[Path, Path, Path], tmp_path: Path, path: str
) -> None:
    """A lone surrogate (JSON allows one in a load request's path) made os.lstat raise
    UnicodeEncodeError inside the policy check: an untyped 500."""
    root, _, _ = layout
    settings = ResolverSettings(policy=SourcePolicy(local_roots=[root]))
    with pytest.raises(AdapterPolicyError, match="not encodable"):
        await LocalResolver(settings).fetch(path.format(root=root), tmp_path / "dest")
