"""benchmarks/kernel_resources.py: a LoRA launch compiled ahead of time for sm_90 on a machine
without a GPU. The pipelined per-slot loop (lora_delta's STAGES, which only the delta on its own,
lora_expand_delta, takes) must come out as asynchronous copies (cp.async) and the branching loop
of the epilogues without them: what the configs claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not _PTXAS.exists(), reason="Triton without its ptxas")

# in a child process: Triton compiles only when the kernels were not imported interpreted
_CHILD = """
import json
from benchmarks import kernel_resources as kr
out = {}
for key, op, cfg in (
    ("silu", "silu_mul", kr.SiluMulConfig(16, 64, 4, 0)),
    ("0", "expand_delta", kr.ExpandDeltaConfig(16, 64, 4, 0)),
    ("2", "expand_delta", kr.ExpandDeltaConfig(16, 64, 4, 2)),
):
    (launch,) = kr.launches(op, cfg, t=32, loras=8, rank=64, column_major=False)
    out[key] = kr.resources(kr.compile_sm90(launch))
print(json.dumps(out))
"""


def test_pipelined_loop_compiles_to_async_copies() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=root, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    silu, branching, piped = res["silu"], res["0"], res["2"]
    assert silu["ldgsts"] == 0 and silu["ldg128"] > 0 and silu["hmma"] > 0
    assert branching["ldgsts"] == 0 and piped["ldgsts"] > 0
    assert branching["hmma"] == piped["hmma"] > 0  # the same dots
    for r in (silu, branching, piped):
        assert 0 < r["regs"] <= 255 and r["warps"] == 4 and 1 <= r["programs_per_sm"] <= 16
