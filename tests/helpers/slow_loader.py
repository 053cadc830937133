"""A loader process with test delays: ``python -m tests.helpers.slow_loader [--delay S]
[--stage-hold S] --conn-fd N [--pool-fd M]`` runs the engine's loader helper with every job
sleeping ``--delay`` seconds first (to kill a helper mid-load) and every stage holding its
host-pool region ``--stage-hold`` seconds, writing, before it packs (not stoppable).

Tests point the engine at it with ``monkeypatch.setattr(loader_process, "helper_command",
command(delay=...))``; the helper imports the test tree from the engine's ``sys.path``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable

__all__ = ["command"]


def command(*, delay: float = 0.0, stage_hold: float = 0.0) -> Callable[[], list[str]]:
    """A stand-in for ``loader_process.helper_command`` that starts this module."""

    def helper_command() -> list[str]:
        args = ["--delay", str(delay), "--stage-hold", str(stage_hold)]
        return [sys.executable, "-m", "tests.helpers.slow_loader", *args]

    return helper_command


def main() -> None:
    from loraplex.engine.adapters import loader_proc_main as loader_helper

    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--stage-hold", type=float, default=0.0)
    args, rest = ap.parse_known_args()
    helper = loader_helper._Helper
    prepare, stage, stage_sync = helper._prepare, helper._stage, helper._stage_sync

    async def slow_prepare(self, p: dict) -> dict:
        await asyncio.sleep(args.delay)
        return await prepare(self, p)

    async def slow_stage(self, p: dict) -> dict:
        await asyncio.sleep(args.delay)
        return await stage(self, p)

    def held_stage_sync(self, p: dict, stop) -> dict:
        time.sleep(args.stage_hold)
        return stage_sync(self, p, stop)

    helper._prepare, helper._stage, helper._stage_sync = slow_prepare, slow_stage, held_stage_sync  # type: ignore[method-assign]
    loader_helper.main(rest)


if __name__ == "__main__":
    main()
