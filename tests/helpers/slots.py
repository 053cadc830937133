"""Slot-store fakes: a writer that writes nothing, and a version's slot write landed the way
the engine lands one (planned, issued, its step collected, polled)."""

from __future__ import annotations

from typing import Any

from loraplex.engine.adapters.slot_store import Landed, SlotJob, SlotStore

__all__ = ["FakeWriter", "land"]


class FakeWriter:
    """A ``SlotWriter`` that records what it is handed and writes nothing; its jobs are done
    when their step is collected (as an inline writer's)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[SlotJob, Any, bool]] = []

    def submit(self, job: SlotJob, after: Any, *, paced: bool) -> None:
        self.jobs.append((job, after, paced))
        job.issued.set()

    def close(self) -> None:
        pass


def land(store: SlotStore, *versions: Any) -> list[Landed]:
    """Each version's write into the slot it holds, landed: what the engine does from
    ``StepExecutor.prepare`` to the loop's next poll (the store's writer must not write)."""
    jobs = store.begin(list(versions), set())
    store.issue(jobs, after=None, busy=set(), read=set())
    store.collected(jobs)
    return store.poll()
