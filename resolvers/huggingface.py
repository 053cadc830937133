"""Hugging Face Hub adapters: ``hf://org/repo[/subdir][@revision]``.

The revision (default ``main``) is resolved to its commit sha once, and both files are then
downloaded at that sha, so a branch moving mid-fetch cannot mix versions; ``pinned_uri`` ends
in ``@<sha>``. huggingface_hub is synchronous: its calls run in a worker thread. It reads
HF_ENDPOINT etc. at import, so endpoint, token and cache are passed explicitly, read from
settings or the environment when the fetch starts. Files land in the Hub cache and are then
copied into ``dest``.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from pathlib import Path

import aiofiles
import aiohttp
from huggingface_hub import HfApi, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

from loraplex.engine.errors import AdapterNotFoundError, AdapterSourceError
from loraplex.plugins import hookimpl
from loraplex.resolvers.base import (
    AdapterSource,
    Report,
    Resolver,
    ResolverSettings,
    copy_file,
    download_parts,
)

__all__ = ["HfUri", "HuggingFaceResolver", "parse_hf_uri", "loraplex_resolvers"]

DEFAULT_ENDPOINT = "https://huggingface.co"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA = re.compile(r"[0-9a-f]{40}")
HF_PART_BYTES = 8 << 20  # a ranged GET's size; files up to it: hf_hub_download (the cache)
HF_PARALLEL_PARTS = 8  # ranged GETs in flight per file
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class HfUri:
    repo_id: str  # org/repo
    subdir: str  # "" for the repo root
    revision: str

    def with_revision(self, revision: str) -> str:
        sub = f"/{self.subdir}" if self.subdir else ""
        return f"hf://{self.repo_id}{sub}@{revision}"


def parse_hf_uri(uri: str) -> HfUri:
    """Split ``hf://org/repo[/subdir][@revision]``; AdapterSourceError if malformed."""
    if not uri.startswith("hf://"):
        raise AdapterSourceError(f"{uri!r} is not an hf:// URI", field="uri")
    path, sep, revision = uri[len("hf://") :].partition("@")
    parts = path.strip("/").split("/")
    if len(parts) < 2 or not all(_NAME.fullmatch(p) for p in parts) or (sep and not revision):
        raise AdapterSourceError(
            f"{uri!r} is not hf://org/repo[/subdir][@revision] (names: letters, digits, ._-)",
            field="uri",
        )
    return HfUri(f"{parts[0]}/{parts[1]}", "/".join(parts[2:]), revision or "main")


def _env(explicit: str | None, *names: str) -> str | None:
    if explicit:
        return explicit
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


class _HfSource(AdapterSource):
    def __init__(
        self, uri: HfUri, sha: str, files: dict[str, int | None], opts: dict, chunk: int
    ) -> None:
        self.pinned_uri, self.files = uri.with_revision(sha), files
        self._uri, self._sha, self._opts, self._chunk = uri, sha, opts, chunk
        self._session: aiohttp.ClientSession | None = None

    def _filename(self, name: str) -> str:
        return f"{self._uri.subdir}/{name}" if self._uri.subdir else name

    async def download(self, name: str, target: Path, report: Report) -> None:
        size = self.files.get(name)
        if size is not None and size > HF_PART_BYTES and not _offline():
            cached = await asyncio.to_thread(self._in_cache, name)
            if cached is None:
                await self._ranged(name, size, target, report)
                return
        try:
            cached = await asyncio.to_thread(self._to_cache, name)
        except RepositoryNotFoundError as e:  # includes gated repos
            raise AdapterNotFoundError(f"{self.pinned_uri!r}: {name}: {e}") from e
        await copy_file(cached, target, report, chunk_bytes=self._chunk)

    def _to_cache(self, name: str) -> str:
        path = hf_hub_download(
            self._uri.repo_id,
            name,
            subfolder=self._uri.subdir or None,
            revision=self._sha,  # pinned: never the branch name
            library_name="loraplex",
            **self._opts,
        )
        return str(path)

    def _in_cache(self, name: str) -> str | None:
        got = try_to_load_from_cache(
            self._uri.repo_id, self._filename(name), cache_dir=self._opts["cache_dir"],
            revision=self._sha,
        )  # fmt: skip
        return got if isinstance(got, str) else None

    async def _ranged(self, name: str, size: int, target: Path, report: Report) -> None:
        """The file as parallel ranged GETs, each part written at its offset (module doc)."""
        url = hf_hub_url(
            self._uri.repo_id, self._filename(name), revision=self._sha,
            endpoint=self._opts["endpoint"],
        )  # fmt: skip
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
            self._session = aiohttp.ClientSession(timeout=timeout, trust_env=True)
        session = self._session
        base = {"Accept-Encoding": "identity", "User-Agent": "loraplex"}
        auth = {"Authorization": f"Bearer {self._opts['token']}"} if self._opts["token"] else {}
        first_hi = min(HF_PART_BYTES, size)
        # the first range follows the redirect (aiohttp drops the token on another origin)
        async with session.get(
            url, headers={**base, **auth, "Range": f"bytes=0-{first_hi - 1}"}
        ) as resp:
            if resp.status in (401, 403, 404):
                raise AdapterNotFoundError(
                    f"{self.pinned_uri!r}: {name}: the Hub answered {resp.status}"
                )
            resp.raise_for_status()
            where = resp.url
            asked = resp.history[0].url if resp.history else resp.url
            if resp.status == 200:  # the server ignores ranges: the whole file in one stream
                async with aiofiles.open(target, "wb") as out:
                    async for chunk in resp.content.iter_chunked(self._chunk):
                        await out.write(chunk)
                        report(len(chunk))
                return
            self._check_range(resp, name, 0, first_hi, size)
            first = await resp.read()
        headers = {**base, **(auth if where.origin() == asked.origin() else {})}

        async def get(lo: int, hi: int) -> bytes:
            async with session.get(
                where, headers={**headers, "Range": f"bytes={lo}-{hi - 1}"}, allow_redirects=False
            ) as r:
                r.raise_for_status()
                self._check_range(r, name, lo, hi, size)
                return await r.read()

        await download_parts(
            target, size, get, report, part_bytes=HF_PART_BYTES, parallel=HF_PARALLEL_PARTS,
            first=first,
        )  # fmt: skip

    def _check_range(
        self, resp: aiohttp.ClientResponse, name: str, lo: int, hi: int, size: int
    ) -> None:
        m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
        if (
            resp.status != 206
            or m is None
            or (int(m[1]), int(m[2]) + 1) != (lo, hi)
            or m[3] not in ("*", str(size))
        ):
            raise AdapterSourceError(
                f"{self.pinned_uri!r}: {name}: asked for bytes {lo}-{hi - 1} of {size}, got "
                f"status {resp.status}, Content-Range {resp.headers.get('Content-Range')!r}",
                field=name,
            )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class HuggingFaceResolver(Resolver):
    """Fetches adapters from the Hub (or any Hub-compatible endpoint)."""

    schemes = ("hf",)

    def _options(self) -> dict:
        s = self.settings
        endpoint = _env(s.hf_endpoint, "HF_ENDPOINT") or DEFAULT_ENDPOINT
        cache = _env(s.hf_cache_dir, "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
        if cache is None and os.environ.get("HF_HOME"):
            cache = os.path.join(os.environ["HF_HOME"], "hub")
        return {
            "endpoint": endpoint.rstrip("/"),
            "token": _env(s.hf_token, "HF_TOKEN"),
            "cache_dir": os.path.expanduser(cache) if cache else None,
        }

    async def open(self, uri: str) -> AdapterSource:
        hf = parse_hf_uri(uri)
        opts = self._options()
        api = HfApi(endpoint=opts["endpoint"], token=opts["token"], library_name="loraplex")
        try:
            info = await asyncio.to_thread(
                api.model_info, hf.repo_id, revision=hf.revision, files_metadata=True
            )
        except RevisionNotFoundError as e:
            raise AdapterNotFoundError(f"{uri!r}: revision {hf.revision!r} not found") from e
        except RepositoryNotFoundError as e:  # includes gated repos
            raise AdapterNotFoundError(f"{uri!r}: repository {hf.repo_id!r} not found: {e}") from e
        sha = info.sha or ""
        if not _SHA.fullmatch(sha):
            raise AdapterSourceError(f"{uri!r}: the Hub returned no commit sha", field="uri")
        prefix = f"{hf.subdir}/" if hf.subdir else ""
        files: dict[str, int | None] = {}
        for sib in info.siblings or ():
            rest = sib.rfilename[len(prefix) :] if sib.rfilename.startswith(prefix) else None
            if rest and "/" not in rest:
                files[rest] = sib.size
        if not files:
            raise AdapterNotFoundError(f"{uri!r}: no files at {hf.subdir or 'the repo root'}")
        return _HfSource(hf, sha, files, opts, self.settings.chunk_bytes)


@hookimpl
def loraplex_resolvers(settings: ResolverSettings) -> list[Resolver]:
    return [HuggingFaceResolver(settings)]
