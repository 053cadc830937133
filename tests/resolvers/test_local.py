"""The local resolver: copies from directories under operator roots, nothing else."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterPolicyError,
    AdapterTooLargeError,
)
from loraplex.resolvers import ResolverSettings
from loraplex.resolvers.local import LocalResolver
from tests.resolvers.tiny_adapter import write_adapter

FILES = ["adapter_config.json", "adapter_model.safetensors"]


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("as_uri", [False, True])
async def test_fetch_from_root(
    root: Path, settings: ResolverSettings, dest: Path, as_uri: bool
) -> None:
    src = root / "good"
    (src / "README.md").write_text("not copied")
    (src / "adapter_model.bin").write_bytes(b"never read")
    uri = src.resolve().as_uri() if as_uri else str(src)
    seen: list[tuple[str, str, int, int | None]] = []
    res = await LocalResolver(settings).fetch(uri, dest, lambda *a: seen.append(a))
    assert res.local_dir == dest
    assert _listing(dest) == FILES  # exactly the two files
    assert adapter_digest(dest) == adapter_digest(src)
    assert res.pinned_uri == src.resolve().as_uri()
    assert res.nbytes == sum((src / f).stat().st_size for f in FILES)
    weights = [s for s in seen if s[1] == "adapter_model.safetensors"]
    size = (src / "adapter_model.safetensors").stat().st_size
    assert weights[0][2] == 0 and weights[-1][2:] == (size, size)
    assert len(weights) > 2  # chunked (chunk_bytes=512)


async def test_dotdot_is_refused(root: Path, settings: ResolverSettings, dest: Path) -> None:
    with pytest.raises(AdapterPolicyError, match=r"'\.\.'"):
        await LocalResolver(settings).fetch(f"{root}/good/../good", dest)


async def test_absolute_path_outside_roots(
    tmp_path: Path, settings: ResolverSettings, dest: Path
) -> None:
    other = write_adapter(tmp_path / "elsewhere")
    with pytest.raises(AdapterPolicyError, match="outside the allowed roots"):
        await LocalResolver(settings).fetch(str(other), dest)
    assert not dest.exists()


async def test_symlinked_dir_escaping_root(
    tmp_path: Path, root: Path, settings: ResolverSettings, dest: Path
) -> None:
    other = write_adapter(tmp_path / "elsewhere")
    (root / "sneaky").symlink_to(other, target_is_directory=True)
    with pytest.raises(AdapterPolicyError, match="resolves to"):
        await LocalResolver(settings).fetch(str(root / "sneaky"), dest)


async def test_symlinked_file_escaping_root(
    tmp_path: Path, root: Path, settings: ResolverSettings, dest: Path
) -> None:
    other = write_adapter(tmp_path / "elsewhere", seed=1)
    (root / "mixed").mkdir()
    shutil.copy(root / "good" / "adapter_config.json", root / "mixed")
    (root / "mixed" / "adapter_model.safetensors").symlink_to(other / "adapter_model.safetensors")
    with pytest.raises(AdapterPolicyError, match="adapter_model.safetensors resolves to"):
        await LocalResolver(settings).fetch(str(root / "mixed"), dest)
    assert not dest.exists()


async def test_symlink_inside_root_is_fine(
    root: Path, settings: ResolverSettings, dest: Path
) -> None:
    (root / "alias").symlink_to(root / "good", target_is_directory=True)
    res = await LocalResolver(settings).fetch(str(root / "alias"), dest)
    assert res.pinned_uri == (root / "good").resolve().as_uri()


async def test_bin_only_is_refused(root: Path, settings: ResolverSettings, dest: Path) -> None:
    d = root / "pickled"
    d.mkdir()
    shutil.copy(root / "good" / "adapter_config.json", d)
    (d / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(AdapterFormatError, match="safetensors required"):
        await LocalResolver(settings).fetch(str(d), dest)
    assert not dest.exists()


async def test_missing_dir(root: Path, settings: ResolverSettings, dest: Path) -> None:
    with pytest.raises(AdapterNotFoundError):
        await LocalResolver(settings).fetch(str(root / "nope"), dest)


async def test_quota_refused_before_copying(
    root: Path, settings: ResolverSettings, dest: Path
) -> None:
    with pytest.raises(AdapterTooLargeError, match="above the quota of 100"):
        await LocalResolver(settings).fetch(str(root / "good"), dest, max_bytes=100)
    assert not dest.exists()
