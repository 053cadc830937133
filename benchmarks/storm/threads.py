"""Where the engine process's CPU goes during a window: CPU seconds per thread, and optionally
a py-spy profile of the GIL holder.

A running stream's token waits whenever the step thread waits for the GIL, so "which thread
burned CPU while the storm ran" is the first question about a slow window. Threads are read
from ``/proc/self/task`` (Linux); Python threads get their ``threading`` name, the others
(CUDA, Triton, OpenMP, torch intra-op) their kernel name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from collections import defaultdict
from pathlib import Path

__all__ = ["thread_cpu", "cpu_by_thread", "GilProfile"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu() -> dict[int, tuple[str, float]]:
    """tid -> (name, user + system CPU seconds so far); empty where /proc is missing."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for entry in tids:
        try:
            stat = Path(f"/proc/self/task/{entry}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        tid = int(entry)
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        out[tid] = (names.get(tid, comm), cpu)
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


def _allow_ptrace_by_children() -> None:
    """Under Yama's ``ptrace_scope`` 1 a process may only be traced by its ancestors; py-spy
    runs as our child, so this process names any tracer as allowed (``PR_SET_PTRACER``).
    Harmless where Yama is absent."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
        libc.prctl(pr_set_ptracer, pr_set_ptracer_any, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class GilProfile:
    """``py-spy record --gil`` of this process over one window (if py-spy is installed and
    may attach): collapsed stacks of whoever held the GIL, written to ``path``."""

    def __init__(self, path: str | Path, rate: int = 500) -> None:
        self.path = Path(path)
        self.rate = rate
        self.proc: subprocess.Popen | None = None

    def start(self) -> bool:
        exe = shutil.which("py-spy")
        if exe is None:
            return False
        _allow_ptrace_by_children()
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(os.getpid()), "--gil", "--threads", "--nonblocking",
             "--rate", str(self.rate), "--format", "raw", "--output", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        return True

    def stop(self) -> str:
        """Stop recording; py-spy's own error output if it failed."""
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return "" if self.path.exists() else err.decode(errors="replace")[-500:]
