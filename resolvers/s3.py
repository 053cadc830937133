"""S3 adapters: ``s3://bucket/prefix`` (the prefix is the adapter's folder).

s3fs runs in async mode on the engine's event loop: a fresh ``S3FileSystem`` per fetch (no
instance cache, so no client bound to another loop), its coroutines awaited, its client
closed afterwards. Objects are streamed in chunks and written with aiofiles, so the loop never
blocks on disk writes and the quota is enforced while bytes arrive. Endpoint, credentials and
region come from settings, else AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN and AWS_DEFAULT_REGION, read when the fetch starts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiofiles

from loraplex.engine.errors import AdapterNotFoundError, AdapterSourceError
from loraplex.plugins import hookimpl
from loraplex.resolvers.base import AdapterSource, Report, Resolver, ResolverSettings

if TYPE_CHECKING:
    from s3fs import S3FileSystem

__all__ = ["S3Resolver", "parse_s3_uri", "loraplex_resolvers"]

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at the ends)."""
    if not uri.startswith("s3://"):
        raise AdapterSourceError(f"{uri!r} is not an s3:// URI", field="uri")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise AdapterSourceError(f"{uri!r}: {bucket!r} is not a valid bucket name", field="uri")
    return bucket, prefix.strip("/")


def _env(explicit: str | None, name: str) -> str | None:
    return explicit or os.environ.get(name) or None


class _S3Source(AdapterSource):
    def __init__(self, fs: S3FileSystem, base: str, pinned_uri: str, chunk: int) -> None:
        self.fs, self.base, self.pinned_uri, self.chunk = fs, base, pinned_uri, chunk
        self.files: dict[str, int | None] = {}

    async def list(self) -> None:
        try:
            entries = await self.fs._ls(self.base, detail=True)
        except FileNotFoundError as e:
            raise AdapterNotFoundError(f"{self.pinned_uri!r} does not exist") from e
        for entry in entries:
            if entry.get("type") == "file":
                name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
                size = entry.get("size")
                self.files[name] = int(size) if size is not None else None

    async def download(self, name: str, target: Path, report: Report) -> None:
        f = await self.fs.open_async(f"{self.base}/{name}", "rb")
        try:
            async with aiofiles.open(target, "wb") as out:
                while chunk := await f.read(self.chunk):
                    await out.write(chunk)
                    report(len(chunk))
        finally:
            body = getattr(f, "r", None)  # the streaming body, left open on an early exit
            if body is not None:
                body.close()
            await f.close()

    async def aclose(self) -> None:
        client = getattr(self.fs, "_s3", None)
        if client is not None:
            await client.close()


class S3Resolver(Resolver):
    """Fetches adapters from S3 or an S3-compatible endpoint."""

    schemes = ("s3",)

    def _filesystem(self) -> S3FileSystem:
        s = self.settings
        region = _env(s.s3_region, "AWS_DEFAULT_REGION") or _env(None, "AWS_REGION")
        kwargs: dict[str, Any] = {
            "asynchronous": True,
            "skip_instance_cache": True,
            "anon": s.s3_anon,
            "endpoint_url": _env(s.s3_endpoint_url, "AWS_ENDPOINT_URL"),
            "key": _env(s.s3_key, "AWS_ACCESS_KEY_ID"),
            "secret": _env(s.s3_secret, "AWS_SECRET_ACCESS_KEY"),
            "token": _env(s.s3_token, "AWS_SESSION_TOKEN"),
            "client_kwargs": {"region_name": region} if region else {},
        }
        from s3fs import S3FileSystem  # lazy: the plugin loads without s3fs installed

        return S3FileSystem(**kwargs)

    async def open(self, uri: str) -> AdapterSource:
        bucket, prefix = parse_s3_uri(uri)
        base = f"{bucket}/{prefix}" if prefix else bucket
        fs = self._filesystem()
        source = _S3Source(fs, base, f"s3://{base}", self.settings.chunk_bytes)
        try:
            await fs.set_session()
            await source.list()
        except BaseException:
            await source.aclose()
            raise
        return source


@hookimpl
def loraplex_resolvers(settings: ResolverSettings) -> list[Resolver]:
    return [S3Resolver(settings)]
