"""The Hugging Face resolver against a small fake Hub on 127.0.0.1 (reached via HF_ENDPOINT)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
