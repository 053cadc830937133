"""The source checkout's names for the cold-load study forward to the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import benchmarks.coldload.adapters as old_adapters
import benchmarks.synthetic as old_synthetic
import loraplex.engine.bench.coldload.adapters as adapters
import loraplex.engine.bench.synthetic as synthetic

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_benchmarks_coldload_forwards() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.coldload", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m benchmarks.coldload")
    assert "--synthetic" in out.stdout and "--sweep" in out.stdout


def test_reexports_are_the_package_objects() -> None:
    assert old_adapters.TINY is adapters.TINY
    assert old_adapters.write_adapter_set is adapters.write_adapter_set
    for name in ("LLAMA3_8B", "random_model", "write_adapter", "write_model_config"):
        assert getattr(old_synthetic, name) is getattr(synthetic, name), name
