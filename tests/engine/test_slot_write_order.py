"""A slot write waits for the step in flight only when that step reads the slot."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from loraplex.engine.executor import InFlightStep, StepExecutor
from loraplex.engine.model_runner import StepItem
from loraplex.engine.scheduler import SchedulerOutput


class _Writer:
    """Records submissions; "issues" each write at once with its own event."""

    def __init__(self) -> None:
        self.jobs: list[tuple[int, object, bool]] = []

    def submit(self, v, slot, adapter, after, *, paced=True) -> threading.Event:
        self.jobs.append((slot, after, paced))
        v.slot_event = f"write of slot {slot}"
        issued = threading.Event()
        issued.set()
        return issued


def _executor() -> StepExecutor:
    ex = StepExecutor.__new__(StepExecutor)
    ex.side_stream = object()  # (a CUDA side stream on the GPU; only its presence matters)
    ex.slot_writer = _Writer()
    ex.last_step_event = "event of the step in flight"
    return ex


def _job(slot: int):
    return (SimpleNamespace(timings={}, name=f"a{slot}", slot_event=None), slot, object())


def _in_flight(*slots: int) -> InFlightStep:
    items = [StepItem([0], 5, [0], s, True, i) for i, s in enumerate(slots)]
    return InFlightStep(SchedulerOutput(), items, [], None, 0.0, 0.0, None, False)


def test_write_waits_only_for_a_step_reading_its_slot() -> None:
    ex = _executor()
    # slot 3: a row of the step in flight still reads it (its request was aborted after that
    # step was planned, and the slot went back to the pool); slot 5: nobody reads it
    assert ex._write_slots([_job(3), _job(5)], _in_flight(-1, 3, 1)) == []
    assert ex.slot_writer.jobs == [(3, "event of the step in flight", True), (5, None, True)]


def test_write_without_a_step_in_flight_starts_at_once() -> None:
    ex = _executor()
    ex._write_slots([_job(2)], None)  # every earlier step was collected
    assert ex.slot_writer.jobs == [(2, None, True)]


def test_write_joined_by_its_rows_is_unpaced_and_waited_on() -> None:
    ex = _executor()
    # rows of this step read slot 4 (they joined its write); slot 6's rows come later
    events = ex._write_slots([_job(4), _job(6)], None, read={4, -1})
    assert ex.slot_writer.jobs == [(4, None, False), (6, None, True)]
    assert events == ["write of slot 4"]


def test_joined_write_that_failed_fails_the_step() -> None:
    ex = _executor()

    def failing(v, slot, adapter, after, *, paced=True):
        issued = threading.Event()
        issued.set()  # the writer thread logged the error; no event
        return issued

    ex.slot_writer.submit = failing
    with pytest.raises(RuntimeError, match="failed"):
        ex._write_slots([_job(4)], None, read={4})
