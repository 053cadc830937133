"""The resolver contract: bring an adapter's two files from a source into a local directory.

A resolver opens a source (``open``) and says which files it holds and how big they are; the
shared ``Resolver.fetch`` then enforces the rules every resolver must keep: the policy check,
exactly ``adapter_config.json`` + ``adapter_model.safetensors`` (a ``.bin``-only source is
refused before anything is downloaded), the byte quota (before downloading when sizes are
known, and while streaming), sizes as listed, and files that appear in ``dest`` only complete.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import aiofiles
import structlog

from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterSourceError,
    AdapterTooLargeError,
    LoRAError,
)
from loraplex.resolvers.policy import SourcePolicy, scheme_of

__all__ = [
    "ADAPTER_FILES",
    "TOKENIZER_FILES",
    "AdapterSource",
    "FetchResult",
    "ProgressCallback",
    "Report",
    "Resolver",
    "ResolverSettings",
    "copy_file",
    "download_parts",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# an adapter's own tokenizer (one that added tokens); fetched only when a caller asks for them
# (``fetch(extra_files=...)``, engines with lora_extra_vocab_size) and only where present
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few hundred bytes
CHUNK_BYTES = 1 << 20
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# progress(uri, file, bytes_done, bytes_total or None); called on the event loop.
ProgressCallback = Callable[[str, str, int, "int | None"], None]
Report = Callable[[int], None]  # a download reports each chunk's size as it is written

log = structlog.get_logger("loraplex.resolvers")


@dataclass(frozen=True)
class ResolverSettings:
    """Operator settings every resolver is built with. ``None`` falls back to the environment
    (read when a fetch starts, not at import)."""

    policy: SourcePolicy = field(default_factory=SourcePolicy)
    hf_endpoint: str | None = None  # else HF_ENDPOINT
    hf_token: str | None = None  # else HF_TOKEN
    hf_cache_dir: str | None = None  # else HF_HUB_CACHE, else $HF_HOME/hub
    s3_endpoint_url: str | None = None  # else AWS_ENDPOINT_URL
    s3_key: str | None = None  # else AWS_ACCESS_KEY_ID
    s3_secret: str | None = None  # else AWS_SECRET_ACCESS_KEY
    s3_token: str | None = None  # else AWS_SESSION_TOKEN
    s3_region: str | None = None  # else AWS_DEFAULT_REGION
    s3_anon: bool = False
    chunk_bytes: int = CHUNK_BYTES
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per plugin name


@dataclass(frozen=True)
class FetchResult:
    local_dir: Path  # holds exactly adapter_config.json and adapter_model.safetensors
    pinned_uri: str  # the source at the exact version fetched (e.g. hf://org/repo@<sha>)
    nbytes: int  # bytes of both files


class AdapterSource(ABC):
    """One opened source directory. ``files`` maps every file name it holds (at least the
    adapter files, and any ``.bin``) to its size, ``None`` when unknown."""

    pinned_uri: str
    files: Mapping[str, int | None]

    @abstractmethod
    async def download(self, name: str, target: Path, report: Report) -> None:
        """Write file ``name`` to ``target``, calling ``report(n)`` after each ``n`` bytes."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Release connections; called once, also after a failure."""

    def local_fd(self, name: str) -> int | None:
        """A new descriptor of file ``name`` when the source holds it on this machine (the
        caller reads it with ``os.pread`` and closes it), else None: the engine then reads,
        hashes and checks the bytes in one pass instead of copying them first."""
        return None


class Resolver(ABC):
    """Fetches adapters for the URI ``schemes`` it declares. Subclasses implement ``open``."""

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: ResolverSettings | None = None) -> None:
        self.settings = settings or ResolverSettings()

    @abstractmethod
    async def open(self, uri: str) -> AdapterSource:
        """Look the source up (no file data yet); raise AdapterNotFoundError if it is absent."""

    async def fetch(
        self,
        uri: str,
        dest: Path,
        progress: ProgressCallback | None = None,
        *,
        max_bytes: int | None = None,
        extra_files: tuple[str, ...] = (),
    ) -> FetchResult:
        """Bring the adapter at ``uri`` into ``dest``, a fresh directory (created if needed).
        ``extra_files``: more files (``TOKENIZER_FILES``) fetched too where the source has them.

        On failure the files this call wrote are removed. Non-adapter errors (network, auth,
        disk) are raised as AdapterSourceError; cancellation propagates unchanged.
        """
        if scheme_of(uri) not in self.schemes:
            raise AdapterSourceError(
                f"{type(self).__name__} cannot fetch {uri!r} (schemes: {', '.join(self.schemes)})",
                field="uri",
            )
        log.info("adapter_fetch_start", uri=uri, resolver=type(self).__name__)
        try:
            source, sizes = await self.open_checked(
                uri, max_bytes=max_bytes, extra_files=extra_files
            )
        except LoRAError as e:
            log.warning("adapter_fetch_failed", uri=uri, error=str(e), kind=type(e).__name__)
            raise
        except Exception as e:  # network, auth: one typed error for the caller
            log.warning("adapter_fetch_failed", uri=uri, error=str(e), kind=type(e).__name__)
            raise AdapterSourceError(f"fetching {uri!r} failed: {e}", field="uri") from e
        try:
            return await self.fetch_opened(uri, source, sizes, dest, progress, max_bytes=max_bytes)
        finally:
            await source.aclose()

    async def fetch_opened(
        self,
        uri: str,
        source: AdapterSource,
        sizes: dict[str, int | None],
        dest: Path,
        progress: ProgressCallback | None = None,
        *,
        max_bytes: int | None = None,
    ) -> FetchResult:
        """``fetch`` of a source ``open_checked`` returned (the caller closes it)."""
        dest = Path(dest)
        t0 = time.monotonic()
        try:
            nbytes = await self._transfer(uri, source, sizes, dest, progress, max_bytes)
        except LoRAError as e:
            log.warning("adapter_fetch_failed", uri=uri, error=str(e), kind=type(e).__name__)
            raise
        except Exception as e:  # network, auth, disk: one typed error for the caller
            log.warning("adapter_fetch_failed", uri=uri, error=str(e), kind=type(e).__name__)
            raise AdapterSourceError(f"fetching {uri!r} failed: {e}", field="uri") from e
        result = FetchResult(local_dir=dest, pinned_uri=source.pinned_uri, nbytes=nbytes)
        log.info(
            "adapter_fetch_done",
            uri=uri,
            pinned_uri=result.pinned_uri,
            nbytes=nbytes,
            seconds=round(time.monotonic() - t0, 3),
        )
        return result

    async def open_checked(
        self, uri: str, *, max_bytes: int | None = None, extra_files: tuple[str, ...] = ()
    ) -> tuple[AdapterSource, dict[str, int | None]]:
        """Open ``uri`` and check its listing as ``fetch`` does (the policy, exactly the two
        adapter files, the config's size, the quota where sizes are known); returns the
        source (the caller closes it: ``aclose``) and the files to bring with their listed
        sizes, the adapter's first, then those of ``extra_files`` the source has."""
        if scheme_of(uri) not in self.schemes:
            raise AdapterSourceError(
                f"{type(self).__name__} cannot fetch {uri!r} (schemes: {', '.join(self.schemes)})",
                field="uri",
            )
        await asyncio.to_thread(self.settings.policy.check, uri)  # defence in depth
        source = await self.open(uri)
        try:
            sizes = _check_listing(uri, source.files, max_bytes)
        except BaseException:
            await source.aclose()
            raise
        for name in extra_files:
            if name in source.files and name not in sizes:
                sizes[name] = source.files[name]
        return source, sizes

    async def _transfer(
        self,
        uri: str,
        source: AdapterSource,
        sizes: dict[str, int | None],
        dest: Path,
        progress: ProgressCallback | None,
        max_bytes: int | None,
    ) -> int:
        await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
        total, moved = 0, []
        try:
            for name in sizes:
                part, expected = dest / f".{name}.part", sizes[name]
                meter = _Meter(uri, name, expected, total, max_bytes, progress)
                meter.start()
                await source.download(name, part, meter)
                size = (await asyncio.to_thread(os.stat, part)).st_size
                if expected is not None and size != expected:
                    raise AdapterSourceError(
                        f"{uri!r}: {name} arrived with {size} bytes, the source listed {expected}",
                        field=name,
                    )
                meter.check(size)
                total += size
                await asyncio.to_thread(os.replace, part, dest / name)
                moved.append(dest / name)
                log.info("adapter_fetch_file", uri=uri, file=name, nbytes=size)
        except BaseException:
            for p in [*(dest / f".{n}.part" for n in sizes), *moved]:
                with contextlib.suppress(OSError):
                    p.unlink()  # NOTE: a metadata op; must also run on cancellation
            raise
        return total


class _Meter:
    """The ``report`` callback of one file: counts bytes, enforces limits, forwards progress."""

    def __init__(
        self,
        uri: str,
        name: str,
        expected: int | None,
        before: int,
        max_bytes: int | None,
        progress: ProgressCallback | None,
    ) -> None:
        self.uri, self.name, self.expected, self.before = uri, name, expected, before
        self.max_bytes, self.progress, self.done = max_bytes, progress, 0
        self.limit = MAX_CONFIG_BYTES if name == CONFIG_FILE else None

    def start(self) -> None:
        if self.progress is not None:
            self.progress(self.uri, self.name, 0, self.expected)

    def __call__(self, n: int) -> None:
        self.done += n
        self.check(self.done)
        if self.progress is not None:
            self.progress(self.uri, self.name, self.done, self.expected)

    def check(self, size: int) -> None:
        if self.limit is not None and size > self.limit:
            raise AdapterConfigError(
                f"{self.uri!r}: {self.name} exceeds the {self.limit}-byte limit", field=self.name
            )
        if self.max_bytes is not None and self.before + size > self.max_bytes:
            raise AdapterTooLargeError(
                f"{self.uri!r}: adapter files exceed the quota of {self.max_bytes} bytes "
                f"(at {self.name})",
                field=self.name,
            )


def _check_listing(
    uri: str, files: Mapping[str, int | None], max_bytes: int | None
) -> dict[str, int | None]:
    if WEIGHTS_FILE not in files:
        pickles = sorted(n for n in files if n.endswith(_PICKLE_SUFFIXES))
        if pickles:
            raise AdapterFormatError(
                f"{uri!r} has {', '.join(pickles)} but no {WEIGHTS_FILE}: safetensors required "
                "(pickle-based weights are never downloaded or loaded)",
                field=WEIGHTS_FILE,
            )
        if CONFIG_FILE not in files:
            raise AdapterNotFoundError(
                f"{uri!r} holds no adapter (no {CONFIG_FILE}, no {WEIGHTS_FILE})"
            )
        raise AdapterFormatError(f"{uri!r} has no {WEIGHTS_FILE}", field=WEIGHTS_FILE)
    if CONFIG_FILE not in files:
        raise AdapterConfigError(f"{uri!r} has no {CONFIG_FILE}", field=CONFIG_FILE)
    sizes = {name: files[name] for name in ADAPTER_FILES}
    cfg = sizes[CONFIG_FILE]
    if cfg is not None and cfg > MAX_CONFIG_BYTES:
        raise AdapterConfigError(
            f"{uri!r}: {CONFIG_FILE} is {cfg} bytes, above the {MAX_CONFIG_BYTES}-byte limit",
            field=CONFIG_FILE,
        )
    known = sum(s for s in sizes.values() if s is not None)
    if max_bytes is not None and known > max_bytes:
        raise AdapterTooLargeError(
            f"{uri!r}: adapter files are {known} bytes, above the quota of {max_bytes}",
            field=WEIGHTS_FILE,
        )
    return sizes


async def copy_file(
    src: Path | str,
    target: Path,
    report: Report,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    opener: Any = None,
) -> None:
    """Copy a local file in chunks with aiofiles, reporting each chunk (helper for resolvers)."""
    async with aiofiles.open(src, "rb", opener=opener) as fin, aiofiles.open(target, "wb") as fout:
        while chunk := await fin.read(chunk_bytes):
            await fout.write(chunk)
            report(len(chunk))


# the parts' disk writes (pwrite at their offsets); a pool of their own so that a download can
# wait for every write it started, also those whose awaiting task was cancelled
_PART_WRITER = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="part-write")


async def download_parts(
    target: Path,
    size: int,
    get: Callable[[int, int], Awaitable[bytes]],
    report: Report,
    *,
    part_bytes: int,
    parallel: int,
    first: bytes | None = None,
) -> None:
    """Write a ``size``-byte file as parts of ``part_bytes``, ``parallel`` of them fetched at
    once by ``get(lo, hi)`` (the bytes ``[lo, hi)``, exactly), each written at its offset
    (helper for resolvers whose source serves byte ranges: one stream tops out far below a
    host's network). ``first``: the first part's bytes when the caller already has them (a
    request that also found the file's final location). The first failure cancels the other
    parts and is raised once no write into ``target`` is in flight any more."""
    parts = [(lo, min(lo + part_bytes, size)) for lo in range(0, size, part_bytes)]
    gate = asyncio.Semaphore(parallel)
    fd = await asyncio.to_thread(os.open, target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    writes: list[concurrent.futures.Future[int]] = []

    async def part(lo: int, hi: int) -> None:
        async with gate:
            data = first if first is not None and lo == 0 else await get(lo, hi)
            if len(data) != hi - lo:
                raise AdapterSourceError(
                    f"{target.name}: bytes {lo}-{hi - 1} arrived as {len(data)} bytes",
                    field=target.name.removeprefix(".").removesuffix(".part"),
                )
            w = _PART_WRITER.submit(os.pwrite, fd, data, lo)
            writes.append(w)
            await asyncio.wrap_future(w)
            report(len(data))  # may raise (quota): the other parts are cancelled

    tasks: list[asyncio.Task[None]] = []
    try:
        await asyncio.to_thread(os.ftruncate, fd, size)
        tasks = [asyncio.ensure_future(part(lo, hi)) for lo, hi in parts]
        await asyncio.gather(*tasks)  # the first part's error propagates
    finally:
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        # a cancelled wait leaves its write running: none may land after the close
        await asyncio.to_thread(concurrent.futures.wait, writes)
        os.close(fd)
