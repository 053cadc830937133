"""A progress bar on stderr: tqdm when installed, else a plain line rewritten in place."""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, desc: str, *, enabled: bool = True) -> None:
        self.total, self.desc, self.done = total, desc, 0
        self.enabled = enabled
        self._bar: Any = None
        self._t0 = self._last = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr)

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 1.0 or self.done >= self.total:
            self._last = now
            sys.stderr.write(
                f"\r{self.desc}: {self.done}/{self.total} requests, {now - self._t0:.0f}s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
