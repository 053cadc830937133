"""``benchmarks.spec_decode --smoke``: the speculative-decoding benchmark the GPU runs still
runs end to end on a tiny CPU model (its greedy outputs with speculation equal the reference
run's: the script asserts it) and prints its tables; the break-even arithmetic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.spec_decode import break_even, tokens_per_verify

ROOT = Path(__file__).resolve().parents[2]


def test_spec_decode_smoke(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.spec_decode", "--smoke", "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for expect in ("| batch | decode ms | verify ms | verify / decode |", "| fixed rate | 1.00 |",
                   "break-even alpha", "| speculation | p50 step ms | tokens/s |"):  # fmt: skip
        assert expect in run.stdout, run.stdout[-2000:]


def test_break_even_arithmetic() -> None:
    assert tokens_per_verify(0.0) == 1.0 and tokens_per_verify(1.0) == 5.0
    assert abs(tokens_per_verify(0.5) - 1.9375) < 1e-12
    a = break_even(1.9375)
    assert abs(a - 0.5) < 1e-9
    assert break_even(0.9) == 0.0
    assert break_even(6.0) != break_even(6.0)  # nan: no acceptance pays for it


def test_verify_host_benchmark_runs(capsys) -> None:
    """``benchmarks.verify_host`` (the verify op by path) on a tiny vocabulary."""
    from benchmarks.verify_host import main

    main(["--device", "cpu", "--vocab", "64", "--rows", "1", "2", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "| rows | general path us | argmax path us | saved |" in out
    assert out.count("\n| 1 |") == 1 and out.count("\n| 2 |") == 1
