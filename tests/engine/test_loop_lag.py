"""LoopLag reads how late a posted callback runs: near zero on an idle loop (no timer
rounding), the length of a blocking callback when one runs."""

from __future__ import annotations

import asyncio
import time

from loraplex.engine.loop_lag import LoopLag


async def test_idle_loop_reads_little_and_a_blocked_loop_reads_the_block():
    seen: list[float] = []
    lag = LoopLag(seen.append, interval=0.002)
    lag.start()
    try:
        await asyncio.sleep(0.3)
        idle = sorted(seen)
        assert len(idle) > 20
        idle_median = idle[len(idle) // 2]
        n = len(seen)
        time.sleep(0.05)  # a callback that blocks the loop for 50 ms
        await asyncio.sleep(0.05)
        blocked = seen[n:]
        assert max(blocked) >= 0.03 > 10 * idle_median
        summary = lag.summary()
        assert summary["loop_lag_max_ms"] >= 30
        assert 0 < summary["loop_lag_p99_ms"] <= summary["loop_lag_max_ms"]
    finally:
        await lag.stop()
    count = len(seen)
    await asyncio.sleep(0.02)
    assert len(seen) == count  # stopped: no more samples
