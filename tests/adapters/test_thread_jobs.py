"""A cancelled stage hands its host-pool region back only once its thread has stopped writing."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from loraplex.engine.adapters.staging import stage_file
from loraplex.engine.adapters.thread_jobs import StageStopped, run_to_end
from tests.resolvers.tiny_adapter import tiny_model_config, write_adapter


async def test_a_cancelled_caller_waits_for_the_thread_and_asks_it_to_stop() -> None:
    started, finished = threading.Event(), threading.Event()
    seen_stop: list[bool] = []

    def work(stop: threading.Event) -> int:
        started.set()
        for _ in range(100):  # "writes" until asked to stop
            if stop.is_set():
                break
            time.sleep(0.005)
        time.sleep(0.05)  # the last write in flight when the stop comes
        seen_stop.append(stop.is_set())
        finished.set()
        raise StageStopped("stopped")

    task = asyncio.create_task(run_to_end(work))
    while not started.is_set():
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()  # a second cancel while it waits changes nothing
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set() and seen_stop == [True]  # returned before the cancellation did


async def test_run_to_end_returns_the_work_and_raises_its_error() -> None:
    assert await run_to_end(lambda stop: 7) == 7

    def bad(stop: threading.Event) -> None:
        raise ValueError("broken")

    with pytest.raises(ValueError, match="broken"):
        await run_to_end(bad)


def test_stage_file_stops_before_writing_when_asked(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a")
    out = torch.full((1 << 14,), 3.0)
    stop = threading.Event()
    stop.set()
    with pytest.raises(StageStopped, match="cancelled"):
        stage_file(str(folder), tiny_model_config(), 8, dtype=torch.float32, out=out, stop=stop)
    assert torch.equal(out, torch.full((1 << 14,), 3.0))  # nothing written


def test_priority_gate_lets_one_in_and_urgent_waiters_first() -> None:
    from loraplex.engine.adapters.loader_proc_main import PriorityGate

    gate, order, inside = PriorityGate(), [], []
    first_in = threading.Event()

    def job(name: str, urgent: bool, hold: float = 0.0) -> None:
        with gate.hold(urgent=urgent):
            inside.append(name)
            assert len(inside) == 1  # one holder at a time
            order.append(name)
            if name == "first":
                first_in.set()
            time.sleep(hold)
            inside.remove(name)

    t0 = threading.Thread(target=job, args=("first", False, 0.3))
    t0.start()
    first_in.wait()
    waiters = [threading.Thread(target=job, args=(f"check{i}", False)) for i in range(3)]
    for t in waiters:
        t.start()
    time.sleep(0.05)  # the checks wait first
    urgent = threading.Thread(target=job, args=("stage", True))
    urgent.start()
    for t in [t0, *waiters, urgent]:
        t.join(5)
    assert order[0] == "first" and order[1] == "stage"  # ahead of the checks that waited longer
    assert sorted(order[2:]) == ["check0", "check1", "check2"]
