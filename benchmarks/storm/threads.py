"""Where the engine process's CPU goes during a window: CPU seconds per thread (the package's
``loraplex.engine.bench.cpu_use``), and optionally a py-spy profile of the GIL holder."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from loraplex.engine.bench.cpu_use import cpu_by_thread, thread_cpu

__all__ = ["thread_cpu", "cpu_by_thread", "GilProfile"]


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
