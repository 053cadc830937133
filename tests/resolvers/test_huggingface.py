"""The Hugging Face resolver against a small fake Hub on 127.0.0.1 (reached via HF_ENDPOINT)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterSourceError,
    AdapterTooLargeError,
)
from loraplex.resolvers import ResolverSettings, SourcePolicy
from loraplex.resolvers.huggingface import HuggingFaceResolver, parse_hf_uri
from tests.resolvers.tiny_adapter import write_adapter

ALLOW = ResolverSettings(policy=SourcePolicy(allow=["hf://org/*"]))
_shas = itertools.count()


class FakeHub:
    """Just the endpoints hf_hub_download and HfApi.model_info use."""

    def __init__(self) -> None:
        self.repos: dict[
            str, dict
        ] = {}  # repo_id -> {"refs": {name: sha}, "commits": {sha: files}}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization)

    def commit(self, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
        sha = hashlib.sha1(f"{repo_id}-{next(_shas)}".encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        repo["commits"][sha], repo["refs"][ref] = dict(files), sha
        return sha

    def _lookup(self, request: web.Request) -> tuple[str, dict[str, bytes]]:
        self.requests.append((request.method, request.path, request.headers.get("Authorization")))
        info = request.match_info
        repo = self.repos.get(f"{info['org']}/{info['name']}")
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"})
        rev = info["rev"]
        sha = repo["refs"].get(rev, rev if rev in repo["commits"] else None)
        if sha is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"})
        return sha, repo["commits"][sha]

    async def model_info(self, request: web.Request) -> web.Response:
        sha, files = self._lookup(request)
        siblings = [
            {"rfilename": p, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
            for p, b in files.items()
        ]
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response(
            {"id": repo_id, "sha": sha, "private": False, "siblings": siblings}
        )

    async def resolve(self, request: web.Request) -> web.Response:
        sha, files = self._lookup(request)
        data = files.get(request.match_info["path"])
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        return web.Response(body=data, headers={"X-Repo-Commit": sha, "ETag": etag})

    def resolved_paths(self) -> list[str]:
        return [p for _, p, _ in self.requests if "/resolve/" in p]


def _adapter_files(folder: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.fixture
async def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeHub]:
    fake = FakeHub()
    app = web.Application()
    app.router.add_get("/api/models/{org}/{name}/revision/{rev}", fake.model_info)
    app.router.add_get("/{org}/{name}/resolve/{rev}/{path:.+}", fake.resolve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    monkeypatch.setenv("HF_ENDPOINT", f"http://{host}:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    yield fake
    await runner.cleanup()


async def test_fetch_pins_the_revision_to_its_sha(hub: FakeHub, tmp_path: Path) -> None:
    old = write_adapter(tmp_path / "old", seed=1)
    new = write_adapter(tmp_path / "new", seed=2)
    sha_old = hub.commit("org/repo", _adapter_files(old), ref="v1")
    sha_new = hub.commit("org/repo", {**_adapter_files(new), "README.md": b"hi"})
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
        "org/multi", {**_adapter_files(a, "adapters/a/"), **_adapter_files(b, "adapters/b/")}
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
    hub.commit("org/repo", _adapter_files(write_adapter(tmp_path / "a")))
    with pytest.raises(AdapterTooLargeError):
        await HuggingFaceResolver(ALLOW).fetch("hf://org/repo", tmp_path / "d", max_bytes=1000)
    assert hub.resolved_paths() == []


async def test_missing_repo_or_revision(hub: FakeHub, tmp_path: Path) -> None:
    hub.commit("org/repo", _adapter_files(write_adapter(tmp_path / "a")))
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
