"""Where a benchmark's CPU goes: CPU seconds per thread of this process (by thread name) and
per child process (loader processes, grammar sandboxes), read from ``/proc`` (Linux; empty
elsewhere).

A running stream's token waits whenever the step thread waits for the GIL, and a load waits
whenever its loader process has no core: "which thread or process burned CPU over the window"
is the first question about a slow one. Python threads get their ``threading`` name, the
others (CUDA, Triton, OpenMP, torch intra-op) their kernel name.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

__all__ = ["children_cpu", "cpu_by_thread", "processes_summary", "thread_cpu"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: str) -> tuple[str, list[str]] | None:
    """(comm, the fields after it) of a /proc stat file; None if it is gone or unreadable."""
    try:
        stat = Path(path).read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def thread_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (name, user + system CPU seconds so far); empty where /proc is missing."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for entry in tids:
        got = _stat(f"/proc/self/task/{entry}/stat")
        if got is None:
            continue  # the thread ended meanwhile
        comm, fields = got
        tid = int(entry)
        out[tid] = (names.get(tid, comm), (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def children_cpu() -> dict[int, tuple[str, float]]:
    """pid -> (command name, CPU seconds of all its threads so far) of this process's
    children (found by their parent pid in ``/proc/*/stat``)."""
    me = os.getpid()
    out: dict[int, tuple[str, float]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return out
    for entry in entries:
        got = _stat(f"/proc/{entry}/stat")
        if got is None:
            continue
        comm, fields = got
        if int(fields[1]) == me:  # ppid
            out[int(entry)] = (comm, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def cpu_by_thread(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """CPU use per thread name (summed over threads of one name) as a share of one core,
    over a window of ``seconds``; threads that used under 1 % are left out."""
    used: dict[str, float] = defaultdict(float)
    for tid, (name, cpu) in after.items():
        used[name] += cpu - before.get(tid, (name, 0.0))[1]
    return {
        k: round(v / seconds, 3)
        for k, v in sorted(used.items(), key=lambda kv: -kv[1])
        if seconds > 0 and v / seconds >= 0.01
    }


def processes_summary(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Child processes over a window: how many ran, their CPU in cores together and the
    busiest one's (a process started in the window counts from zero)."""
    used = [cpu - before.get(pid, ("", 0.0))[1] for pid, (_, cpu) in after.items()]
    if seconds <= 0:
        return {"count": len(used), "cores": 0.0, "busiest": 0.0}
    return {
        "count": len(used),
        "cores": round(sum(used) / seconds, 3),
        "busiest": round(max(used, default=0.0) / seconds, 3),
    }
