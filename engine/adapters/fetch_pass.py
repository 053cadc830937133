"""``fetch_and_check``: the checks every fetched adapter passes before it is registered (in the
engine process or in a loader process alike), run as one pass per byte (onepass.py).

A source whose files are on this machine (the local resolver: descriptors opened inside the
allowed roots) is read once: each byte hashed, checked, written to the staging copy and, when
the caller asks for it, packed into its slot image in the same pass. Any other source (S3, the
Hub) is downloaded into the staging folder first (that is the fetch), then the pass reads the
copy once. Either way nothing is kept unless the digest matched and every check passed: the
staging folder is removed, and the image's memory is the caller's to give back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.adapters.files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.engine.adapters.onepass import PassResult, PassSource, read_pass
from loraplex.engine.adapters.seal import Seal, seal_folder
from loraplex.engine.adapters.thread_jobs import run_to_end
from loraplex.engine.errors import AdapterDigestError
from loraplex.resolvers.base import FetchResult

__all__ = ["Fetched", "fetch_and_check"]


@dataclass
class Fetched:
    result: FetchResult  # the staging folder, pinned URI, bytes
    digest: str
    stages: dict[str, float]  # fetch (open / download), preflight, verify (the pass's parts)
    checked: PassResult  # the config, the preflight report, the slot image if one was asked


def _expect(name: str, shown_uri: str, sha256: str | None, expect_digest: str) -> Any:
    def check(digest: str) -> None:
        if sha256 is not None and sha256.lower().removeprefix("sha256:") != digest:
            raise AdapterDigestError(
                f"sha256 mismatch for adapter {name!r} from {shown_uri!r}: configured "
                f"{sha256.lower()}, content has {digest}",
                field="sha256",
            )
        if expect_digest and expect_digest != digest:
            raise AdapterDigestError(
                f"adapter {name!r} at {shown_uri!r} changed: digest {digest[:12]}..., "
                f"expected {expect_digest[:12]}...",
                field="sha256",
            )

    return check


async def fetch_and_check(
    resolver: Any,
    uri: str,
    dest: Path,
    *,
    name: str,
    shown_uri: str,
    sha256: str | None,
    expect_digest: str,
    model_config: Any,
    max_lora_rank: int,
    max_bytes: int,
    progress: Any = None,
    full_modules: bool = False,
    extra_files: tuple[str, ...] = (),
    cpu_gate: AbstractContextManager[Any] | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    pin: bool = False,
    defer_copy: bool = False,
) -> Fetched:
    """Fetch ``uri`` into ``dest`` (removed again on any failure) and check it in one pass.
    ``dtype``: also pack the slot image (into ``out``: a host-pool region's view, else a new
    buffer, pinned if ``pin``); ``extra_files``: optional files fetched too (an adapter's
    tokenizer, added_tokens.py); ``cpu_gate``: held around the pass (a loader helper's
    one-at-a-time gate for GIL-bound work); ``defer_copy``: a local source's staging copy is
    written after the pass (``Fetched.checked.copy``: onepass.py)."""
    t1 = time.perf_counter()
    check = _expect(name, shown_uri, sha256, expect_digest)
    downloaded: Seal | None = None
    try:
        if hasattr(resolver, "open_checked"):
            source, sizes = await resolver.open_checked(
                uri, max_bytes=max_bytes, extra_files=extra_files
            )
        else:  # a plugin resolver of its own making: its fetch, then the pass over the copy
            source, sizes = None, {}
        try:
            fds = _local_fds(source)
            if fds is not None:
                src = PassSource(fds[0], fds[1], sizes[CONFIG_FILE] or 0, sizes[WEIGHTS_FILE] or 0)
                pinned = source.pinned_uri  # type: ignore[union-attr]
                copy_to: Path | None = dest
                try:
                    await asyncio.to_thread(dest.mkdir, parents=True, exist_ok=True)
                    for extra in (n for n in sizes if n not in (CONFIG_FILE, WEIGHTS_FILE)):
                        await source.download(extra, dest / extra, lambda n: None)  # type: ignore[union-attr]
                except BaseException:
                    src.close()
                    raise
            else:
                if source is not None:
                    got = await resolver.fetch_opened(
                        uri, source, sizes, dest, progress, max_bytes=max_bytes
                    )
                else:
                    more = {"extra_files": extra_files} if extra_files else {}
                    got = await resolver.fetch(uri, dest, progress, max_bytes=max_bytes, **more)
                # the download is sealed before the pass reads it: the seal (its digest set
                # once verified) then holds for exactly the bytes the pass hashed
                dest, pinned, copy_to = got.local_dir, got.pinned_uri, None
                downloaded = await asyncio.to_thread(seal_folder, dest, "")
                src = PassSource.open_dir(dest)
        finally:
            if source is not None:
                await source.aclose()
        t2 = time.perf_counter()
        try:

            def one_pass(stop: Any) -> PassResult:
                with cpu_gate or contextlib.nullcontext():
                    got = read_pass(
                        src, model_config, max_lora_rank=max_lora_rank, max_bytes=max_bytes,
                        full_modules=full_modules, dtype=dtype, pin=pin, out=out,
                        copy_to=copy_to, expect=check, stop=stop, sealed=downloaded,
                        defer_copy=defer_copy,
                    )  # fmt: skip
                if downloaded is not None:
                    got.seal = replace(downloaded, digest=got.digest)
                return got

            checked = await run_to_end(one_pass)
        finally:
            src.close()
        t3 = time.perf_counter()
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, dest, True)
        raise
    result = FetchResult(local_dir=dest, pinned_uri=pinned, nbytes=checked.nbytes)
    # preflight: the config and header checks (before any tensor byte); verify: the rest of
    # the pass (hash, value checks, staging copy and, when asked, the pack)
    pre = checked.header_s
    stages = {"fetch": t2 - t1, "preflight": pre, "verify": max(0.0, t3 - t2 - pre)}
    return Fetched(result, checked.digest, stages, checked)


def _local_fds(source: Any) -> tuple[int, int] | None:
    """Descriptors of the source's two files when it holds them here (else None)."""
    get = getattr(source, "local_fd", None)
    if get is None:
        return None
    cfd = get(CONFIG_FILE)
    if cfd is None:
        return None
    wfd = get(WEIGHTS_FILE)
    if wfd is None:
        os.close(cfd)
        return None
    return cfd, wfd
