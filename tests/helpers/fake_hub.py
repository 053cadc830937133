"""A small fake Hugging Face Hub on 127.0.0.1 (reached through HF_ENDPOINT): ``FakeHub`` (just the
endpoints hf_hub_download and HfApi.model_info use, byte ranges included, and optionally a
redirect of file downloads to a second origin as the Hub's CDN), ``adapter_files`` (a folder as
a commit's files) and the ``hub`` fixture (a pytest plugin, loaded by tests/conftest.py)."""

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
        self.ranges: list[
            tuple[str, str, str | None]
        ] = []  # (host, path, authorization) of ranged GETs
        self.cdn: str | None = None  # "http://host:port": downloads redirect there (the fixture)
        self.redirect = False  # resolve answers 302 to ``cdn`` (as the Hub does for large files)
        self.ignore_ranges = False  # serve whole files (a server without range support)
        self.short_ranges = False  # answer ranges one byte short

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
        headers = {"X-Repo-Commit": sha, "ETag": etag}
        if self.redirect and request.method == "GET" and self.cdn is not None:
            raise web.HTTPFound(f"{self.cdn}/blob/{request.match_info['org']}/"
                                f"{request.match_info['name']}/{sha}/{request.match_info['path']}",
                                headers=headers)  # fmt: skip
        return self._body(request, data, headers)

    async def blob(self, request: web.Request) -> web.Response:
        """The second origin's files (``cdn``): what ``resolve`` redirected to."""
        info = request.match_info
        repo = self.repos.get(f"{info['org']}/{info['name']}")
        data = repo["commits"].get(info["sha"], {}).get(info["path"]) if repo else None
        if data is None:
            raise web.HTTPNotFound()
        return self._body(request, data, {})

    def _body(self, request: web.Request, data: bytes, headers: dict) -> web.Response:
        """The file, or the byte range the request asks for (206, Content-Range)."""
        rng = request.headers.get("Range")
        if rng is None or self.ignore_ranges or request.method != "GET":
            return web.Response(body=data, headers=headers)
        self.ranges.append((request.host, request.path, request.headers.get("Authorization")))
        lo, _, hi = rng.removeprefix("bytes=").partition("-")
        a, b = int(lo), min(int(hi), len(data) - 1)
        body = data[a : b + 1 - (1 if self.short_ranges else 0)]
        headers = {**headers, "Content-Range": f"bytes {a}-{b}/{len(data)}"}
        return web.Response(status=206, body=body, headers=headers)

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
    cdn_app = web.Application()  # a second origin (another port) for redirected downloads
    cdn_app.router.add_get("/blob/{org}/{name}/{sha}/{path:.+}", fake.blob)
    cdn = web.AppRunner(cdn_app)
    await cdn.setup()
    await web.TCPSite(cdn, "127.0.0.1", 0).start()
    fake.cdn = "http://{}:{}".format(*cdn.addresses[0][:2])
    monkeypatch.setenv("HF_ENDPOINT", f"http://{host}:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    yield fake
    await runner.cleanup()
    await cdn.cleanup()
