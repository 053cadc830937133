"""``benchmarks.moe_decode --smoke``: the MoE decode benchmark the GPU runs (Qwen3-30B-A3B
shape) still runs end to end on a tiny shape on CPU and prints its table, with the floor's
parts and the slot bytes of an adapter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_decode_benchmark_smoke() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.moe_decode", "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "| adapters | batch | experts / layer | GB / step | floor ms |" in out, out[-2000:]
    assert "slot bytes per rank-16 attention adapter" in out
    assert "experts 0.0" in out and "kv 0.0" in out  # the floor's parts
    rows = [line for line in out.splitlines() if line.startswith("| 8 | 4 |")]
    assert rows and rows[-1].endswith("% |"), out[-2000:]  # LoRA overhead against base rows
