"""A slot write waits for the step in flight only when that step reads the slot; rows that
joined a write wait for its event (the executor's order, on a fake writer behind the store)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.adapters.version import AdapterState, AdapterVersion
from loraplex.engine.executor import InFlightStep, StepExecutor
from loraplex.engine.model_runner import StepItem
from loraplex.engine.scheduler import SchedulerOutput


class _Writer:
    """Records submissions; "issues" each write at once with its own events."""

    def __init__(self) -> None:
        self.jobs: list[tuple[int, object, bool]] = []

    def submit(self, job, after, *, paced: bool) -> None:
        self.jobs.append((job.slot, after, paced))
        job.events = ("start", "copied", f"write of slot {job.slot}")
        job.issued.set()

    def close(self) -> None:
        pass


def _executor(num_slots: int = 8) -> tuple[StepExecutor, _Writer]:
    writer = _Writer()
    ex = StepExecutor.__new__(StepExecutor)
    ex.slots = SlotStore(num_slots, writer=writer)
    ex.last_step_event = "event of the step in flight"
    return ex, writer


def _jobs(ex: StepExecutor, *slots: int) -> list:
    """Jobs of versions written into ``slots`` (the store hands out the lowest free slot)."""
    versions = []
    for slot in range(max(slots) + 1):
        v = AdapterVersion(f"a{slot}", "", "d", 1, state=AdapterState.CPU)
        v.adapter = SimpleNamespace(rank=4, nbytes=1, dora=None, image=None)
        assert ex.slots.assign(v) == slot
        versions.append(v)
    return ex.slots.begin([versions[s] for s in slots], set())


def _rows(*slots: int) -> list[StepItem]:
    return [StepItem([0], 5, [0], s, True, i) for i, s in enumerate(slots)]


def _in_flight(*slots: int) -> InFlightStep:
    return InFlightStep(SchedulerOutput(), _rows(*slots), [], None, 0.0, 0.0, None, False)


def test_write_waits_only_for_a_step_reading_its_slot() -> None:
    ex, writer = _executor()
    # slot 3: a row of the step in flight still reads it (its request was aborted after that
    # step was planned, and the slot went back to the pool); slot 5: nobody reads it
    jobs = _jobs(ex, 3, 5)
    assert ex._issue_slot_writes(jobs, _rows(), _in_flight(-1, 3, 1)) == []
    assert writer.jobs == [(3, "event of the step in flight", True), (5, None, True)]


def test_write_without_a_step_in_flight_starts_at_once() -> None:
    ex, writer = _executor()
    ex._issue_slot_writes(_jobs(ex, 2), _rows(), None)  # every earlier step was collected
    assert writer.jobs == [(2, None, True)]


def test_write_joined_by_its_rows_is_unpaced_and_waited_on() -> None:
    ex, writer = _executor()
    # rows of this step read slot 4 (they joined its write); slot 6's rows come later
    events = ex._issue_slot_writes(_jobs(ex, 4, 6), _rows(4, -1), None)
    assert writer.jobs == [(4, None, False), (6, None, True)]
    assert events == ["write of slot 4"]


def test_joined_write_that_failed_fails_the_step() -> None:
    ex, writer = _executor()

    def failing(job, after, *, paced: bool) -> None:
        job.error = RuntimeError("copy failed")  # the writer thread logged it; no events
        job.issued.set()

    writer.submit = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="failed"):
        ex._issue_slot_writes(_jobs(ex, 4), _rows(4), None)
