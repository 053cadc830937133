"""The decode benchmarks' CPU smoke modes (``benchmarks.decode --smoke``, ``benchmarks.mixed_rank
--smoke``): the scripts the H200 runs still run end to end and print their tables (a smoke run
that measured no full decode step used to end in an empty median)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "expect"),
    [
        ("benchmarks.decode", "| weights | adapters | batch | pipelined | overhead |"),
        ("benchmarks.mixed_rank", "rank 8 in a rank-64 engine / in a rank-8 engine:"),
    ],
)
def test_decode_benchmark_smoke(module: str, expect: str, tmp_path: Path) -> None:
    """``benchmarks.decode`` writes into the given ``--workdir``; ``benchmarks.mixed_rank``
    without one into a temporary dir that it removes when it ends (on the GPU its adapters
    take ~3 GB a run)."""
    args = ["--workdir", str(tmp_path)] if module == "benchmarks.decode" else []
    env = dict(os.environ, TMPDIR=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-m", module, "--smoke", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert expect in run.stdout, run.stdout[-2000:]
    if not args:
        assert not list(tmp_path.glob("loraplex-bench-*")), "the benchmark left its work dir"


def test_dora_epilogues_smoke() -> None:
    """``benchmarks.dora_epilogues --smoke``: every variant runs and matches its twin."""
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.dora_epilogues", "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for op in ("qkv_rope", "add_rmsnorm", "silu_mul"):
        assert f"| {op} | 2 | 8 |" in run.stdout, run.stdout[-2000:]
