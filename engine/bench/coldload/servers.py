"""Local adapter servers for studies and tests, each on 127.0.0.1 in a thread of this process.

- ``S3Server``: moto's S3 server (objects live in this process's memory).
- ``HubServer``: the two Hugging Face Hub endpoints the resolver uses (``model_info`` with
  files metadata, and ``resolve`` for HEAD/GET of a file or of one byte range), serving repos
  from local folders.
  It runs its own event loop in its own thread, so serving bytes never runs on the loop of
  the engine under study.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path

__all__ = ["S3Server", "HubServer", "S3_ENV", "hf_cache_env"]

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto's threaded S3 server; ``env`` points boto3 / s3fs at it with dummy credentials."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer  # lazy: moto[server] is a test extra

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {**S3_ENV, "AWS_ENDPOINT_URL": self.endpoint, "AWS_SESSION_TOKEN": ""}
        self._buckets: set[str] = set()

    def _client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_ENV["AWS_DEFAULT_REGION"],
        )

    def upload(self, bucket: str, prefix: str, folders: Iterable[tuple[str, Path]]) -> int:
        """Upload each ``(name, folder)``'s files to ``s3://bucket/prefix/name/``; bytes sent."""
        s3 = self._client()
        if bucket not in self._buckets:
            s3.create_bucket(Bucket=bucket)
            self._buckets.add(bucket)
        sent = 0
        for name, folder in folders:
            for f in sorted(folder.iterdir()):
                s3.upload_file(str(f), bucket, f"{prefix}/{name}/{f.name}")
                sent += f.stat().st_size
        return sent

    def stop(self) -> None:
        self._server.stop()


class HubServer:
    """A fake Hub serving ``org/name`` repos (one commit each) from local folders."""

    def __init__(self) -> None:
        self.repos: dict[str, tuple[str, Path]] = {}  # repo id -> (commit sha, folder)
        self._etags: dict[tuple[int, int], str] = {}  # (device, inode) -> sha256
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner = None
        self.requests = 0
        self._thread = threading.Thread(target=self._serve, name="coldload-hub", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError("the fake hub did not start") from self._error
        self.env = {"HF_ENDPOINT": self.endpoint, "HF_TOKEN": "hf_coldload_dummy"}

    def add_repo(self, repo_id: str, folder: Path) -> str:
        """Serve ``folder``'s files as repo ``repo_id`` at one commit; returns its sha."""
        sha = hashlib.sha1(f"{repo_id}:{folder}".encode()).hexdigest()
        with self._lock:
            self.repos[repo_id] = (sha, folder)
        return sha

    def _etag(self, path: Path) -> str:
        st = path.stat()
        key = (st.st_dev, st.st_ino)
        with self._lock:
            tag = self._etags.get(key)
        if tag is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            tag = h.hexdigest()
            with self._lock:
                self._etags[key] = tag
        return tag

    def _lookup(self, request) -> tuple[str, Path]:
        from aiohttp import web

        self.requests += 1
        info = request.match_info
        with self._lock:
            repo = self.repos.get(f"{info['org']}/{info['name']}")
        if repo is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"})
        sha, folder = repo
        if info["rev"] not in ("main", sha):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"})
        return sha, folder

    async def _model_info(self, request):
        from aiohttp import web

        sha, folder = self._lookup(request)
        siblings = [
            {"rfilename": p.name, "size": p.stat().st_size, "blobId": self._etag(p)[:40]}
            for p in sorted(folder.iterdir())
            if p.is_file()
        ]
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response(
            {"id": repo_id, "sha": sha, "private": False, "siblings": siblings}
        )

    async def _resolve(self, request):
        from aiohttp import web

        sha, folder = self._lookup(request)
        name = request.match_info["path"]
        path = folder / name
        if "/" in name or not path.is_file():
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{self._etag(path)}"'}
        size = path.stat().st_size
        if request.method == "HEAD":
            headers["Content-Length"] = str(size)
            return web.Response(body=b"", headers=headers)
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes=") and "," not in rng:  # one byte range (the ranged fetch)
            lo, _, hi = rng.removeprefix("bytes=").partition("-")
            a, b = int(lo), min(int(hi) if hi else size - 1, size - 1)
            with open(path, "rb") as f:
                body = os.pread(f.fileno(), b - a + 1, a)
            headers["Content-Range"] = f"bytes {a}-{b}/{size}"
            return web.Response(status=206, body=body, headers=headers)
        return web.Response(body=path.read_bytes(), headers=headers)

    def _serve(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)

        async def setup() -> str:
            app = web.Application()
            app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._model_info)
            app.router.add_route("HEAD", "/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
            app.router.add_route("GET", "/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            host, port = self._runner.addresses[0][:2]
            return f"http://{host}:{port}"

        try:
            self.endpoint = self._loop.run_until_complete(setup())
        except BaseException as e:  # noqa: BLE001 - reported by the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        if self._runner is not None:
            self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


def hf_cache_env(cache_dir: Path) -> dict[str, str]:
    """Point the Hub client's cache at ``cache_dir`` (one per point: no warm cache carried over)."""
    os.makedirs(cache_dir, exist_ok=True)
    return {"HF_HUB_CACHE": str(cache_dir), "HF_HUB_DISABLE_TELEMETRY": "1"}
