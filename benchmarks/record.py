"""How benchmarks stamp what they record: the commit, and a result block appended to a file."""

from __future__ import annotations

import datetime
import os
import subprocess

__all__ = ["git_commit", "append_cpu_record"]


def git_commit() -> str | None:
    """The short hash of HEAD, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


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
