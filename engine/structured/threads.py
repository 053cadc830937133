"""How many threads fill a step's grammar masks (and how many lanes a constraint gets)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["fill_threads"]


def _cpus() -> int:
    """CPUs this process may use: its affinity, bounded by a cgroup v2 CPU quota."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota != "max":
        cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    return cpus


@functools.cache
def fill_threads() -> int:
    """Threads that fill a step's masks: 80 % of the CPUs this process may use (at most 32),
    llguidance's own default, leaving cores to the event loop and the step thread. Also the
    number of lanes per constraint (grammars.py)."""
    return min(32, max(1, _cpus() * 4 // 5))
