"""The Hugging Face resolver against a small fake Hub on 127.0.0.1 (reached via HF_ENDPOINT)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from huggingface_hub import hf_hub_download

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterSourceError,
    AdapterTooLargeError,
)
from loraplex.resolvers import ResolverSettings, SourcePolicy
from loraplex.resolvers.huggingface import HuggingFaceResolver, parse_hf_uri
from tests.helpers.fake_hub import FakeHub, adapter_files
from tests.resolvers.tiny_adapter import write_adapter

ALLOW = ResolverSettings(policy=SourcePolicy(allow=["hf://org/*"]))


async def test_fetch_pins_the_revision_to_its_sha(hub: FakeHub, tmp_path: Path) -> None:
    old = write_adapter(tmp_path / "old", seed=1)
    new = write_adapter(tmp_path / "new", seed=2)
    sha_old = hub.commit("org/repo", adapter_files(old), ref="v1")
    sha_new = hub.commit("org/repo", {**adapter_files(new), "README.md": b"hi"})
    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d")
    assert res.pinned_uri == f"hf://org/repo@{sha_new}"
    assert adapter_digest(res.local_dir) == adapter_digest(new)
    assert sorted(p.name for p in res.local_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert hub.resolved_paths() and all(f"/resolve/{sha_new}/" in p for p in hub.resolved_paths())
    assert not any("README" in p for p in hub.resolved_paths())
    assert {auth for *_, auth in hub.requests} == {"Bearer hf_test_token"}
    assert (tmp_path / "hub-cache" / "models--org--repo").is_dir()  # HF_HUB_CACHE honoured

    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/repo@v1", tmp_path / "e")
    assert res.pinned_uri == f"hf://org/repo@{sha_old}"
    assert adapter_digest(res.local_dir) == adapter_digest(old)


async def test_subdir(hub: FakeHub, tmp_path: Path) -> None:
    a = write_adapter(tmp_path / "a", seed=3)
    b = write_adapter(tmp_path / "b", seed=4)
    sha = hub.commit(
        "org/multi", {**adapter_files(a, "adapters/a/"), **adapter_files(b, "adapters/b/")}
    )
    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/multi/adapters/b@main", tmp_path / "d")
    assert res.pinned_uri == f"hf://org/multi/adapters/b@{sha}"
    assert adapter_digest(res.local_dir) == adapter_digest(b)


async def test_bin_only_repo_is_refused_without_downloading(hub: FakeHub, tmp_path: Path) -> None:
    hub.commit("org/pickled", {"adapter_config.json": b"{}", "adapter_model.bin": b"\x80\x04"})
    with pytest.raises(AdapterFormatError, match="safetensors required"):
        await HuggingFaceResolver(ALLOW).fetch("hf://org/pickled", tmp_path / "d")
    assert hub.resolved_paths() == []


async def test_quota_refused_before_downloading(hub: FakeHub, tmp_path: Path) -> None:
    hub.commit("org/repo", adapter_files(write_adapter(tmp_path / "a")))
    with pytest.raises(AdapterTooLargeError):
        await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d", max_bytes=1000)
    assert hub.resolved_paths() == []


async def test_missing_repo_or_revision(hub: FakeHub, tmp_path: Path) -> None:
    hub.commit("org/repo", adapter_files(write_adapter(tmp_path / "a")))
    with pytest.raises(AdapterNotFoundError, match="revision 'nope'"):
        await HuggingFaceResolver(ALLOW).fetch("hf://org/repo@nope", tmp_path / "d")
    with pytest.raises(AdapterNotFoundError, match="repository"):
        await HuggingFaceResolver(ALLOW).fetch("hf://org/absent", tmp_path / "d")


def test_parse_hf_uri() -> None:
    u = parse_hf_uri("hf://org/repo/sub/dir@refs/pr/1")
    assert (u.repo_id, u.subdir, u.revision) == ("org/repo", "sub/dir", "refs/pr/1")
    assert parse_hf_uri("hf://org/repo").revision == "main"
    for bad in ("hf://repo", "hf://org/repo@", "hf://org/.hidden", "hf://org/re po"):
        with pytest.raises(AdapterSourceError):
            parse_hf_uri(bad)


# -- large files: parallel byte ranges straight into dest ----------------------------------------


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 1 KiB, 3 in flight: the tiny adapter's weights take the ranged path."""
    monkeypatch.setattr("loraplex.resolvers.huggingface.HF_PART_BYTES", 1024)
    monkeypatch.setattr("loraplex.resolvers.huggingface.HF_PARALLEL_PARTS", 3)


def _weights_size(folder: Path) -> int:
    return (folder / "adapter_model.safetensors").stat().st_size


async def test_large_file_read_as_parallel_ranges(
    hub: FakeHub, tmp_path: Path, small_parts: None
) -> None:
    a = write_adapter(tmp_path / "a", seed=5)
    size = _weights_size(a)
    assert size > 3 * 1024  # several parts, more than one round of the gate
    sha = hub.commit("org/repo", adapter_files(a))
    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d")
    assert adapter_digest(res.local_dir) == adapter_digest(a)
    assert len(hub.ranges) == -(-size // 1024)  # one GET per part, every part once
    assert all(p.endswith(f"/resolve/{sha}/adapter_model.safetensors") for _, p, _ in hub.ranges)
    assert {auth for *_, auth in hub.ranges} == {"Bearer hf_test_token"}  # (same origin)
    # the weights went straight into dest, not through the Hub cache (the config did)
    cached = [p.name for p in (tmp_path / "hub-cache").rglob("*") if p.is_file()]
    assert "adapter_config.json" in cached and "adapter_model.safetensors" not in cached


async def test_redirected_ranges_go_to_the_file_host_without_the_token(
    hub: FakeHub, tmp_path: Path, small_parts: None
) -> None:
    """The Hub redirects large files to its CDN: the first range follows the redirect, the
    others go there directly, and the token stays with the Hub's own origin."""
    a = write_adapter(tmp_path / "a", seed=6)
    hub.commit("org/repo", adapter_files(a))
    hub.redirect = True
    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d")
    assert adapter_digest(res.local_dir) == adapter_digest(a)
    assert hub.cdn is not None and hub.ranges
    assert all(f"http://{host}" == hub.cdn for host, _, _ in hub.ranges)
    assert {auth for *_, auth in hub.ranges} == {None}
    resolves = [p for m, p, _ in hub.requests if m == "GET" and p.endswith(".safetensors")]
    assert len(resolves) == 1  # only the first range asked the Hub


async def test_a_server_without_ranges_still_serves_the_file(
    hub: FakeHub, tmp_path: Path, small_parts: None
) -> None:
    a = write_adapter(tmp_path / "a", seed=7)
    hub.commit("org/repo", adapter_files(a))
    hub.ignore_ranges = True
    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d")
    assert adapter_digest(res.local_dir) == adapter_digest(a)


async def test_a_short_range_fails_typed_and_leaves_nothing(
    hub: FakeHub, tmp_path: Path, small_parts: None
) -> None:
    hub.commit("org/repo", adapter_files(write_adapter(tmp_path / "a", seed=8)))
    hub.short_ranges = True
    with pytest.raises(AdapterSourceError, match="Content-Range|arrived as"):
        await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d")
    assert not any((tmp_path / "d").iterdir())


async def test_a_file_in_the_hub_cache_is_not_downloaded_again(
    hub: FakeHub, tmp_path: Path, small_parts: None
) -> None:
    a = write_adapter(tmp_path / "a", seed=9)
    sha = hub.commit("org/repo", adapter_files(a))
    # another tool put the weights in the Hub cache (in a thread: the fake Hub runs on this loop)
    await asyncio.to_thread(
        hf_hub_download, "org/repo", "adapter_model.safetensors", revision=sha,
        endpoint=os.environ["HF_ENDPOINT"], token="hf_test_token",
        cache_dir=str(tmp_path / "hub-cache"),
    )  # fmt: skip
    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "e")
    assert adapter_digest(res.local_dir) == adapter_digest(a) and hub.ranges == []


async def test_offline_takes_the_hub_cache_path(
    hub: FakeHub, tmp_path: Path, small_parts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With HF_HUB_OFFLINE set a large file goes through hf_hub_download (which serves it
    from its cache offline), never the ranged GETs."""
    a = write_adapter(tmp_path / "a", seed=10)
    hub.commit("org/repo", adapter_files(a))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d")
    assert adapter_digest(res.local_dir) == adapter_digest(a) and hub.ranges == []
