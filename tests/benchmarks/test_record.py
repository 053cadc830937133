"""benchmarks/record.py: the commit a benchmark stamps on what it records."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.record import git_commit

ROOT = Path(__file__).resolve().parents[2]


def test_commit_is_this_checkouts_head_or_the_named_one(monkeypatch):
    monkeypatch.delenv("LORAPLEX_COMMIT", raising=False)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    assert git_commit() == (head or None)  # (None where the tests run from a copy without git)
    monkeypatch.setenv("LORAPLEX_COMMIT", "0123abc")  # a copy of the tree names its commit
    assert git_commit() == "0123abc"
