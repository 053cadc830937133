"""Intake: a burst of callers passes one at a time, ``spacing`` apart, FIFO, and other
callbacks run between them; a lone caller passes at once."""

from __future__ import annotations

import asyncio

from loraplex.engine.intake import Intake


async def test_callers_pass_spaced_in_order():
    intake = Intake(spacing=0.005)
    loop = asyncio.get_running_loop()
    times: list[float] = []
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
        times.append(loop.time())
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
    # and ``spacing`` apart: released by timers at their time or later (each caller runs a
    # loop iteration after its release, so the times it reads jitter by a little)
    assert all(b - a >= 0.004 for a, b in zip(times, times[1:], strict=False)), times
    # a lone caller, once the burst is ``spacing`` behind, passes without waiting a turn
    await asyncio.sleep(0.006)
    turned = []
    loop.call_soon(turned.append, 1)
    await intake.turn()
    assert not turned  # (it did not even yield to the loop)


async def test_cancelled_waiter_is_skipped_and_intake_reopens():
    intake = Intake(spacing=0.002)
    passed: list[int] = []

    async def caller(i: int):
        await intake.turn()
        passed.append(i)

    tasks = [asyncio.create_task(caller(i)) for i in range(4)]
    await asyncio.sleep(0)  # 0 passes at once, 1..3 wait
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert passed == [0, 2, 3]
    await asyncio.sleep(0.003)
    await asyncio.wait_for(caller(9), 1)  # open again: passes without a waiter ahead
    assert passed[-1] == 9


async def test_a_caller_of_a_later_turn_passes_at_once_when_nobody_waits():
    intake = Intake(spacing=10.0)  # (a spacing no test run could wait out)
    await intake.turn()  # the turn's first: at once
    await asyncio.sleep(0)  # later loop turns
    first = asyncio.ensure_future(intake.turn())  # two callers of one later turn:
    second = asyncio.ensure_future(intake.turn())
    await asyncio.sleep(0.01)
    assert first.done()  # nobody waits: at once, 10 s spacing or not
    assert not second.done()  # the same turn's second waits its spacing
    second.cancel()
