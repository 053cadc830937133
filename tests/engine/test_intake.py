"""Intake: a burst of callers passes one per loop turn, FIFO, and other callbacks run
between them."""

from __future__ import annotations

import asyncio

from loraplex.engine.intake import Intake


async def test_one_caller_per_turn_in_order():
    intake = Intake()
    order: list[str] = []
    ticks = 0
    stop = False

    async def ticker():  # one step per loop turn, like the engine's step loop callbacks
        nonlocal ticks
        while not stop:
            ticks += 1
            order.append(f"t{ticks}")
            await asyncio.sleep(0)

    async def caller(i: int):
        await intake.turn()
        order.append(f"c{i}")

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    await asyncio.gather(*(caller(i) for i in range(6)))
    stop = True
    await t
    calls = [x for x in order if x.startswith("c")]
    assert calls == [f"c{i}" for i in range(6)]
    # between two callers, the ticker ran at least once
    idx = [order.index(c) for c in calls]
    for a, b in zip(idx, idx[1:], strict=False):
        assert any(x.startswith("t") for x in order[a + 1 : b]), order


async def test_cancelled_waiter_is_skipped_and_intake_reopens():
    intake = Intake()
    passed: list[int] = []

    async def caller(i: int):
        await intake.turn()
        passed.append(i)

    tasks = [asyncio.create_task(caller(i)) for i in range(4)]
    await asyncio.sleep(0)  # 0 passes at once, 1..3 wait
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert passed == [0, 2, 3]
    for _ in range(3):
        await asyncio.sleep(0)
    await asyncio.wait_for(caller(9), 1)  # open again: passes without a waiter ahead
    assert passed[-1] == 9
