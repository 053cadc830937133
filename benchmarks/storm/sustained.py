"""Sustained registrations: the load rate one engine keeps while streams decode (issue 41:
">= 150 loads/s of 27 MB adapters with running streams' ITL p99 within 1.15 x quiet").

``--sustained RATE SECONDS``: after the storms, a new adapter is registered every 1 / RATE s
for SECONDS with ``add_adapter`` (fetch, sha256, checks and the slot image packed into the CPU
tier: the host side of a load, in the helpers), each under its own name over
``--sustained-distinct`` weight files (hard links: every name is its own load and digest
check; rank ``--rank``, modules ``--sustained-targets``: q/k/v/o is 27 MB at the 8B shape).
Once more of them are registered than half the CPU tier, the oldest is removed, so that each
registration finds room and packs its image. No request uses them: the window measures the
loads' own ceiling and what they cost the running streams, where the cold-load study measures
the request rate the GPU finishes (BENCHMARKS.md, "Cold-load rate"). Slot writes are a
request's, not part of it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks.coldload.adapters import AdapterSet, write_adapter_set
from loraplex.engine import AsyncEngine

__all__ = ["add_flags", "prepare", "register_at_rate"]


def add_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--sustained", type=float, nargs=2, default=None, metavar=("RATE", "SECONDS"),
        help="after the storms: register RATE new adapters a second for SECONDS (no requests)",
    )  # fmt: skip
    ap.add_argument("--sustained-targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--sustained-distinct", type=int, default=8, help="distinct weight files")


def prepare(args: argparse.Namespace, cfg: dict, work: Path) -> AdapterSet | None:
    """The sustained window's adapter folders (None without ``--sustained``)."""
    if not args.sustained:
        return None
    rate, seconds = args.sustained
    return write_adapter_set(
        work / "sustained", cfg, num=max(1, round(rate * seconds)), rank=args.rank,
        targets=tuple(args.sustained_targets.split(",")), distinct=args.sustained_distinct,
    )  # fmt: skip


async def register_at_rate(
    engine: AsyncEngine, adapters: AdapterSet, rate: float, keep: int
) -> dict[str, Any]:
    """Register ``adapters`` one every 1 / ``rate`` s (each call its own task: a slow load
    does not hold back the next), removing the oldest finished one past ``keep``; returns
    the window's figures (``loads``: the caller's ``adapter_load`` events of the window)."""
    t0 = time.perf_counter()
    done: deque[str] = deque()
    failed = 0

    async def one(i: int, name: str) -> None:
        nonlocal failed
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await engine.add_adapter(name, str(adapters.folder(name)))
        except Exception:  # noqa: BLE001 - counted: a refused load is a figure, not a crash
            failed += 1
            return
        done.append(name)
        while len(done) > keep:
            await engine.remove_adapter(done.popleft())

    await asyncio.gather(*(one(i, n) for i, n in enumerate(adapters.names)))
    seconds = time.perf_counter() - t0
    for name in done:  # (the next window starts with the CPU tier as before)
        await engine.remove_adapter(name)
    return {
        "seconds": seconds,
        "sustained": {
            "offered_per_s": rate, "sent": len(adapters.names), "failed": failed,
            "seconds": seconds, "mb_each": adapters.folder_bytes / 1e6,
        },
    }  # fmt: skip
