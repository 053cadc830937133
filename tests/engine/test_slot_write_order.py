"""A slot write waits for the step in flight only when that step reads the slot."""

from __future__ import annotations

from types import SimpleNamespace

from loraplex.engine.executor import InFlightStep, StepExecutor
from loraplex.engine.model_runner import StepItem
from loraplex.engine.scheduler import SchedulerOutput


class _Writer:
    def __init__(self) -> None:
        self.jobs: list[tuple[int, object]] = []

    def submit(self, v, slot, adapter, after) -> None:
        self.jobs.append((slot, after))


def _executor() -> StepExecutor:
    ex = StepExecutor.__new__(StepExecutor)
    ex.side_stream = object()  # (a CUDA side stream on the GPU; only its presence matters)
    ex.slot_writer = _Writer()
    ex.last_step_event = "event of the step in flight"
    return ex


def _job(slot: int):
    return (SimpleNamespace(timings={}), slot, object())


def _in_flight(*slots: int) -> InFlightStep:
    items = [StepItem([0], 5, [0], s, True, i) for i, s in enumerate(slots)]
    return InFlightStep(SchedulerOutput(), items, [], None, 0.0, 0.0, None, False)


def test_write_waits_only_for_a_step_reading_its_slot() -> None:
    ex = _executor()
    # slot 3: a row of the step in flight still reads it (its request was aborted after that
    # step was planned, and the slot went back to the pool); slot 5: nobody reads it
    ex._write_slots([_job(3), _job(5)], _in_flight(-1, 3, 1))
    assert ex.slot_writer.jobs == [(3, "event of the step in flight"), (5, None)]


def test_write_without_a_step_in_flight_starts_at_once() -> None:
    ex = _executor()
    ex._write_slots([_job(2)], None)  # every earlier step was collected
    assert ex.slot_writer.jobs == [(2, None)]
