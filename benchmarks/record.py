"""How benchmarks stamp what they record: the commit, and a result block appended to a file."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

__all__ = ["git_commit", "append_cpu_record"]


def git_commit() -> str | None:
    """The short hash of this checkout's HEAD; ``LORAPLEX_COMMIT`` if set (a copy of the tree
    without its .git, e.g. ``git archive`` output carried to another machine, names its commit
    so); None when neither is known. A copy inside another checkout is not that checkout's
    HEAD: None then."""
    if commit := os.environ.get("LORAPLEX_COMMIT"):
        return commit
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "--short", "HEAD"],
            capture_output=True, text=True, check=True, timeout=10, cwd=root,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if len(lines) != 2 or Path(lines[0]).resolve() != root:
        return None
    return lines[1]


def append_cpu_record(
    path: str, command: str, text: str, threads: int | None, note: str | None = None
) -> None:
    """Append ``text`` (a table) to ``path`` under date, commit, machine and command lines."""
    head = (
        f"\n- date: {datetime.date.today()}, commit: {git_commit()}, machine: "
        f"{os.cpu_count()}-core CPU, torch threads: {threads}\n"
        f"- command: `{command}`\n"
    )
    with open(path, "a") as f:
        f.write(head + (f"- {note}\n" if note else "") + "\n" + text + "\n")
