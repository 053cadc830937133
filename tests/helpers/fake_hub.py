"""A small fake Hugging Face Hub on 127.0.0.1 (reached through HF_ENDPOINT): ``FakeHub`` (just the
endpoints hf_hub_download and HfApi.model_info use), ``adapter_files`` (a folder as a commit's
files) and the ``hub`` fixture (a pytest plugin, loaded by tests/conftest.py)."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

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


def adapter_files(folder: Path, prefix: str = "") -> dict[str, bytes]:
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
