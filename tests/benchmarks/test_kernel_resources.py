"""benchmarks/kernel_resources.py: a LoRA epilogue's launch compiled ahead of time for sm_90 on a
machine without a GPU, its resources read back from the cubin: the tensor-core delta (a 16-token
block) as HMMA, 128-bit loads, and the epilogues' branching per-slot loop without asynchronous
copies (cp.async)."""

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
cfg = kr.SiluMulConfig(16, 64, 4, 0)
(launch,) = kr.launches("silu_mul", cfg, t=32, loras=8, rank=64, column_major=False)
print(json.dumps(kr.resources(kr.compile_sm90(launch))))
"""


def test_an_epilogue_launch_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, cwd=root, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["ldgsts"] == 0 and r["ldg128"] > 0 and r["hmma"] > 0
    assert 0 < r["regs"] <= 255 and r["warps"] == 4 and 1 <= r["programs_per_sm"] <= 16
