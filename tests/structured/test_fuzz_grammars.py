"""The structured-output fuzz (benchmarks/fuzz_grammars.py) in a CI-sized budget: hostile JSON
schemas, regexes, Lark / GBNF grammars, choice lists and tool definitions through the compile
path and the engine's mask path, in a subprocess. It must end by itself with no crash of its
own process (the engine's side) and nothing but 400s; crashes the sandbox contained are fine.
The long budget's figures are in BENCHMARKS.md."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 20  # (CI; the long run is on the benchmark page)


def test_fuzz_finds_no_crash_of_the_engine_side(tmp_path):
    last = tmp_path / "last.json"
    seed = random.randrange(2**31)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.fuzz_grammars", "--seconds", str(SECONDS),
         "--seed", str(seed), "--last", str(last)],
        capture_output=True, text=True, cwd=ROOT, timeout=SECONDS + 240,
    )  # fmt: skip
    where = f"seed {seed}; last input: {last.read_text()[:2000] if last.exists() else None}"
    assert proc.returncode == 0, f"{where}\n{proc.stderr[-4000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["engine_crashes"] == 0 and summary["inputs"] > 100, summary
    assert summary["accepted"] > 0 and summary["refused"] > 0, summary  # both kinds reached
    # NOTE: completed walks that a schema does not validate (``invalid_outputs``) are counted,
    # not asserted: jsonschema and the grammar library differ on float multipleOf and the like;
    # the long run's count is on the benchmark page
