"""benchmarks/kernel_resources.py: an epilogue launch compiled ahead of time for sm_90 on a
machine without a GPU. The pipelined per-slot LoRA loop (lora_delta's STAGES, alone or with
silu_mul's slices paired) must come out as asynchronous copies (cp.async) and the branching loop
without them: what the configs claim."""

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
for key, stages, paired in (("0", 0, False), ("2", 2, False), ("2p", 2, True)):
    cfg = kr.SiluMulConfig(16, 64, 4, 0, stages, paired)
    (launch,) = kr.launches("silu_mul", cfg, t=32, loras=8, rank=64, column_major=False)
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
    branching, piped, paired = res["0"], res["2"], res["2p"]
    assert branching["ldgsts"] == 0 and branching["ldg128"] > 0
    assert piped["ldgsts"] > 0 and paired["ldgsts"] > 0
    assert branching["hmma"] == piped["hmma"] > 0  # the same dots
    assert 0 < paired["hmma"] < piped["hmma"]  # one loop body for both slices
    for r in (branching, piped, paired):
        assert 0 < r["regs"] <= 255 and r["warps"] == 4 and 1 <= r["programs_per_sm"] <= 16
