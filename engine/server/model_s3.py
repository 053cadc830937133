"""Base models from S3: ``s3://bucket/prefix`` (the prefix is the model folder).

The folder is listed and read through the S3 adapter resolver's own source
(``resolvers/s3.py``: s3fs on its event loop, endpoint and credentials from AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...), and the files the engine reads (``model_files.plan_files``) land in
a local cache folder: ``$HF_HOME/loraplex/s3/<bucket>/<prefix>``, or
``<--download-dir>/s3/<bucket>/<prefix>``. A file whose size and ETag match the last download
is not fetched again. The memory estimate's ``s3_metadata`` reads config.json and only the
safetensors headers (ranged reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from loraplex.engine.server.model_files import (
    CONFIG_FILE,
    INDEX_FILE,
    MAX_JSON_BYTES,
    ModelAccessError,
    ModelMetadata,
    ModelNetworkError,
    ModelNotFoundError,
    ModelSourceError,
    check_model_dir,
    header_length,
    metadata_from,
    parse_header,
    plan_files,
    read_json,
)

if TYPE_CHECKING:
    from loraplex.resolvers.base import AdapterSource

__all__ = ["fetch_s3_model", "s3_metadata", "s3_cache_dir"]

log = structlog.get_logger("loraplex.server")
_MANIFEST = ".loraplex-etags.json"  # file name -> ETag of the copy in the folder


def s3_cache_dir(bucket: str, prefix: str, download_dir: str | None) -> Path:
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ModelSourceError(f"s3://{bucket}/{prefix}: '.' and '..' are not folder names here")
    if download_dir:
        root = Path(download_dir).expanduser() / "s3"
    else:
        from huggingface_hub import constants

        home = os.environ.get("HF_HOME") or constants.HF_HOME
        root = Path(home).expanduser() / "loraplex" / "s3"
    return root.joinpath(bucket, *parts)


def _error(e: BaseException, uri: str) -> ModelSourceError:
    from loraplex.engine.errors import AdapterNotFoundError

    if isinstance(e, ModelSourceError):
        return e
    if isinstance(e, (AdapterNotFoundError, FileNotFoundError)):
        return ModelNotFoundError(f"{uri} does not exist")
    if isinstance(e, PermissionError):
        return ModelAccessError(
            f"{uri}: access denied ({e}); set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a "
            "profile) with read access"
        )
    return ModelNetworkError(f"cannot read {uri}: {type(e).__name__}: {e}")


async def _open(uri: str) -> AdapterSource:
    from loraplex.resolvers.base import ResolverSettings
    from loraplex.resolvers.s3 import S3Resolver

    source = await S3Resolver(ResolverSettings()).open(uri)
    if not source.files:
        await source.aclose()
        raise ModelNotFoundError(f"{uri} holds no files")
    return source


async def _etags(source: Any) -> dict[str, str]:
    entries = await source.fs._ls(source.base, detail=True)
    out = {}
    for e in entries:
        if e.get("type") == "file":
            out[e["name"].rstrip("/").rsplit("/", 1)[-1]] = str(e.get("ETag", ""))
    return out


def _read_manifest(dest: Path) -> dict[str, str]:
    with contextlib.suppress(OSError, ValueError):
        found = json.loads((dest / _MANIFEST).read_text())
        if isinstance(found, dict):
            return {str(k): str(v) for k, v in found.items()}
    return {}


async def _get(source: Any, name: str, dest: Path, report: Any) -> None:
    part = dest / f".{name}.{os.getpid()}.part"
    try:
        await source.download(name, part, report)
        await asyncio.to_thread(os.replace, part, dest / name)
    finally:
        with contextlib.suppress(OSError):
            part.unlink()  # NOTE: a metadata op; must also run on cancellation


async def _fetch(uri: str, dest: Path, bars: bool) -> Path:
    source = await _open(uri)
    try:
        sizes, etags = dict(source.files), await _etags(source)
        await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
        old = _read_manifest(dest)

        def fresh(name: str) -> bool:
            p = dest / name
            ok = p.is_file() and p.stat().st_size == sizes[name]
            return ok and bool(etags.get(name)) and old.get(name) == etags[name]

        if INDEX_FILE in sizes and not fresh(INDEX_FILE):
            await _get(source, INDEX_FILE, dest, lambda n: None)
        files = plan_files(sizes, lambda: read_json(dest / INDEX_FILE), uri)
        todo = [f for f in files if f != INDEX_FILE and not fresh(f)]
        total = sum(sizes[f] or 0 for f in todo)
        log.info("model_download_start", model=uri, files=len(todo), bytes=total,
                 cached=len(files) - len(todo))  # fmt: skip
        t0 = time.monotonic()
        bar = None
        if bars:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"Downloading {uri}")
        try:
            for i, name in enumerate(todo, 1):
                await _get(source, name, dest, bar.update if bar else lambda n: None)
                log.info("model_download_file", model=uri, file=name, bytes=sizes[name],
                         done=f"{i}/{len(todo)}")  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
        manifest = {f: etags.get(f, "") for f in files}
        await asyncio.to_thread((dest / _MANIFEST).write_text, json.dumps(manifest))
        log.info("model_download_done", model=uri, path=str(dest), bytes=total,
                 seconds=round(time.monotonic() - t0, 2))  # fmt: skip
    finally:
        await source.aclose()
    return dest


def fetch_s3_model(bucket: str, prefix: str, *, download_dir: str | None, bars: bool) -> Path:
    """The local folder of the S3 model at ``s3://bucket/prefix``, downloaded if needed."""
    uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    dest = s3_cache_dir(bucket, prefix, download_dir)
    try:
        folder = asyncio.run(_fetch(uri, dest, bars))
    except Exception as e:  # noqa: BLE001 - mapped to one typed error
        raise _error(e, uri) from e
    check_model_dir(folder)
    return folder


async def _range(source: Any, name: str, start: int, end: int) -> bytes:
    return await source.fs._cat_file(f"{source.base}/{name}", start=start, end=end)


async def _metadata(uri: str) -> ModelMetadata:
    source = await _open(uri)
    try:
        names = dict(source.files)

        async def small_json(name: str) -> Any:
            if (names.get(name) or 0) > MAX_JSON_BYTES:
                raise ModelSourceError(f"{uri}/{name} is larger than {MAX_JSON_BYTES} bytes")
            raw = await source.fs._cat_file(f"{source.base}/{name}")
            try:
                return json.loads(raw)
            except ValueError as e:
                raise ModelSourceError(f"{uri}/{name} is not valid JSON: {e}") from None

        index = await small_json(INDEX_FILE) if INDEX_FILE in names else None
        files = plan_files(names, lambda: index, uri)
        headers = {}
        for name in files:
            if name.endswith(".safetensors"):
                n = header_length(await _range(source, name, 0, 8), f"{uri}/{name}")
                raw = await _range(source, name, 8, 8 + n)
                headers[name] = parse_header(raw, f"{uri}/{name}")
        return metadata_from(uri, await small_json(CONFIG_FILE), headers)
    finally:
        await source.aclose()


def s3_metadata(bucket: str, prefix: str) -> ModelMetadata:
    """config.json and the safetensors headers of the S3 model, without its tensor data."""
    uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    try:
        return asyncio.run(_metadata(uri))
    except Exception as e:  # noqa: BLE001 - mapped to one typed error
        raise _error(e, uri) from e
