"""``benchmarks.spec_quoting --smoke``: the real-checkpoint speculation benchmark still runs end
to end on a tiny random model (adapter training included), its greedy outputs identical with
and without speculation, and prints its tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_spec_quoting_benchmark_smoke() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.spec_quoting", "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "| requests | tokens/s off | tokens/s ngram | x off |" in out, out[-2000:]
    rows = [line for line in out.splitlines() if line.startswith(("| quote |", "| (base) |"))]
    assert len(rows) == 2, out[-2000:]  # the adapter's requests and the base model's
