"""The checks every fetched adapter passes before it is registered, in the engine process or in
a loader process alike: fetch into a fresh folder, sha256 digest (against the configured one
and, for a re-fetch, the version's own), header preflight, value check of every weight."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from loraplex.engine.lora.adapter import check_adapter_values
from loraplex.engine.lora.digest import adapter_digest
from loraplex.engine.lora.errors import AdapterDigestError
from loraplex.engine.lora.preflight import PreflightReport, preflight

__all__ = ["fetch_and_check"]


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
) -> tuple[Any, str, dict[str, float], PreflightReport]:
    """Fetch ``uri`` into ``dest`` (removed again on any failure) and check it; returns the
    resolver's FetchResult, the digest, the seconds of fetch / verify / preflight and the
    preflight's report (rank, config). ``full_modules``: modules_to_save tables are served;
    ``extra_files``: optional files fetched too (an adapter's tokenizer, added_tokens.py);
    ``cpu_gate``: held around the header and value checks (a loader helper's one-at-a-time
    gate for GIL-bound work)."""
    t1 = time.perf_counter()
    try:
        more = {"extra_files": extra_files} if extra_files else {}  # (plugin resolvers)
        result = await resolver.fetch(uri, dest, progress, max_bytes=max_bytes, **more)
        t2 = time.perf_counter()
        digest = await asyncio.to_thread(adapter_digest, result.local_dir)
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
        t3 = time.perf_counter()

        def checks() -> PreflightReport:
            with cpu_gate or contextlib.nullcontext():
                report = preflight(
                    result.local_dir, model_config, max_lora_rank=max_lora_rank,
                    max_bytes=max_bytes, full_modules=full_modules,
                )  # fmt: skip
                check_adapter_values(
                    result.local_dir, model_config, max_lora_rank=max_lora_rank,
                    full_modules=full_modules,
                )  # fmt: skip
            return report

        report = await asyncio.to_thread(checks)
        t4 = time.perf_counter()
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, dest, True)
        raise
    stages = {"fetch": t2 - t1, "verify": t3 - t2, "preflight": t4 - t3}
    return result, digest, stages, report
