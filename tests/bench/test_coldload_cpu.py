"""The cold-load study's account of where the CPU went over a run (engine/bench/cpu_use.py):
the engine's threads by name, its loader processes as child processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.engine.bench.coldload.sweep import run_study
from tests.helpers.coldload import point as _point

pytest.importorskip("matplotlib")


def test_cpu_by_thread_and_loader_process_is_reported(tmp_path: Path) -> None:
    """Where the CPU went over the run: the engine's step thread by name, and its loader
    process as a child process that did the loads' work (summary and text)."""
    study = run_study(_point(loader_processes=1), tmp_path, progress=False, quiet=True)
    cpu = study.results[0].summary["cpu"]
    assert any(name.startswith("loraplex-step") for name in cpu["threads"]), cpu
    assert all(0 < v < 4 for v in cpu["threads"].values())
    children = cpu["children"]
    assert children["count"] >= 1 and 0 < children["busiest"] <= children["cores"], children
    assert "child processes" in (tmp_path / "summary.txt").read_text()
