"""When to plan the step queued behind a running one while adapter loads are about to land.

Pipelined decode plans step N+1 as soon as step N-1's tokens arrive, i.e. when N starts on
the device. A request whose adapter lands a moment later misses N+1 and rides in N+2: its
first token comes 2-3 steps after its load. While a waiting request's adapter is loading,
the step loop may instead hold the plan of N+1 until the load lands or until the latest
moment N+1 can still be queued before N ends (N's start + the step period - a margin for
planning, launching and the loop timer's rounding), whichever comes first. Holding never
moves a row to a later step as long as that deadline holds: the plan is made before the
running step ends, only later within it.
"""

from __future__ import annotations

from collections import deque

__all__ = ["LatePlan"]


class LatePlan:
    """The step period, from the moments chained steps start on the device."""

    def __init__(self, margin_s: float | None) -> None:
        self.margin_s = margin_s  # None: never hold
        self._periods: deque[float] = deque(maxlen=8)
        self._started: float | None = None  # when the step now running started

    def first(self, t: float) -> None:
        """A step was launched with none before it: it starts about now."""
        self._started = t

    def next(self, t: float) -> None:
        """The running step's tokens arrived at ``t``: the step queued behind it starts."""
        if self._started is not None:
            self._periods.append(t - self._started)
        self._started = t

    def hold_s(self, now: float) -> float:
        """How long the next plan may still wait (0: plan now). The shortest recent period:
        a late estimate would hold past the deadline, an early one only plans sooner."""
        if self.margin_s is None or self._started is None or len(self._periods) < 2:
            return 0.0
        return max(0.0, self._started + min(self._periods) - self.margin_s - now)
