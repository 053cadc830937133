"""How slot writes are issued: the one write path's two writers and the job they take.

``SlotStore.issue`` (slot_store.py) hands every ``SlotJob`` to the engine's writer, which calls
one target, the model runner's ``write_slot(slot, adapter, **decisions)`` (per rank under
tensor parallelism: ``ParallelRunner`` sends each worker its shard):

- ``ThreadWriter`` (CUDA, one rank). Issued from the step thread, each 84 MB slot write held
  up the launch of the next step, and queued whole it kept the copy engine busy for
  milliseconds, so the next decode step's few-KB input copy waited behind it: steps with writes
  in flight took 17-45 ms instead of 6. Here a write waits (on the side stream) for the step in
  flight only when that step may still read the slot's old contents (the store passes its event
  only then), else starts at once, overlapping it; moves the packed image host -> device in
  ``chunk_bytes`` pieces, each issued only once the previous one has landed (the thread sleeps
  meanwhile, without the GIL), so a step's input copy waits behind at most one chunk; then
  scatters it into the slot on the side stream and records the events the store polls.
- ``InlineWriter`` (the CPU, tensor parallelism): the write now, in the step thread, on the
  current stream; done once its step is collected (``SlotStore.collected``).

Either drops the job's host-pool hold once its copy is issued (with the copy's event on CUDA).
A write that fails is logged and recorded on its job (``error``); the writer goes on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import torch

from loraplex.engine.adapters.host_pool import HostPool, Region

__all__ = ["InlineWriter", "SlotJob", "SlotWriter", "ThreadWriter"]

log = structlog.get_logger("loraplex.engine")

WriteTarget = Callable[..., None]  # runner.write_slot(slot, adapter, **decisions)


@dataclass(eq=False)
class SlotJob:
    """One slot write, as ``SlotStore.begin`` planned it on the loop: a snapshot of the version's
    adapter and host-pool region (held until the copy is issued) and the decisions; what the
    writer reports back. ``events``: (start, copied, done) CUDA events, set last by the thread
    writer; ``done``: an inline write's step was collected; ``error``: the write failed."""

    version: Any  # AdapterVersion
    slot: int
    source: Any  # its adapter (a SlotSource)
    region: Region | None
    zero_rest: bool
    had_dora: bool
    joined: bool  # rows of the step that issues it read the slot behind it
    nbytes: int  # bytes its host -> device copy moves
    issued: threading.Event = field(default_factory=threading.Event)
    h2d_start: float | None = None  # perf_counter when the step thread issued it
    events: tuple[Any, Any, Any] | None = None
    done: bool = False
    error: BaseException | None = None

    def landed(self) -> bool:
        """Its write completed on the device (loop: no wait)."""
        if self.events is not None:
            return bool(self.events[2].query())
        return self.done


class SlotWriter(Protocol):
    def submit(self, job: SlotJob, after: Any, *, paced: bool) -> None:
        """Step thread: write ``job`` once the step whose event is ``after`` (None: none) has
        completed; ``paced`` False: one host -> device copy (a step waits for it anyway).
        Sets ``job.issued`` once the write is issued (or has failed)."""
        ...

    def close(self) -> None: ...


class InlineWriter:
    """Writes in the calling (step) thread, on the current stream (see the module docstring).
    ``write`` None: a store that never writes (registry-only tests)."""

    def __init__(self, write: WriteTarget | None, pool: HostPool | None = None) -> None:
        self.write = write
        self.pool = pool

    def submit(self, job: SlotJob, after: Any, *, paced: bool) -> None:
        if self.write is None:
            raise RuntimeError("this slot store has no writer")
        try:
            self.write(job.slot, job.source, zero_rest=job.zero_rest, had_dora=job.had_dora)
        except Exception as e:
            job.error = e
            raise
        finally:
            if job.region is not None and self.pool is not None:
                self.pool.unhold(job.region)  # (a synchronous copy, or none from the region)
            job.issued.set()

    def close(self) -> None:
        pass


class ThreadWriter:
    """CUDA, one rank: its own thread and side stream, paced copies (module docstring). Only
    ``submit`` and ``close`` are called from other threads."""

    def __init__(
        self,
        write: WriteTarget,
        stream: torch.cuda.Stream,
        pool: HostPool | None = None,
        chunk_bytes: int = 8 << 20,
    ) -> None:
        self.write = write
        self.stream = stream
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="loraplex-slot-writer", daemon=True)
        self._thread.start()

    def submit(self, job: SlotJob, after: Any, *, paced: bool) -> None:
        if not self._thread.is_alive():  # fail the step loudly rather than wait forever
            raise RuntimeError("the slot writer thread is not running")
        self._jobs.put((job, after, paced))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _pace(self, event: torch.cuda.Event) -> None:
        while not event.query():
            time.sleep(5e-5)

    def _run(self) -> None:
        torch.cuda.set_device(self.stream.device)  # (a torch.device with its index)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, after, paced = item
            done = None
            try:
                with torch.cuda.stream(self.stream):
                    if after is not None:
                        self.stream.wait_event(after)
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(self.stream)
                    copied = torch.cuda.Event(enable_timing=True)
                    self.write(
                        job.slot, job.source, zero_rest=job.zero_rest, had_dora=job.had_dora,
                        h2d_done=copied, chunk_bytes=self.chunk_bytes if paced else None,
                        pace=self._pace if paced else None,
                    )  # fmt: skip
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(self.stream)
                job.events = (start, copied, done)  # NOTE: set last: the loop polls it
            except Exception as e:  # noqa: BLE001 - a failed write must not kill the thread
                name = getattr(job.version, "name", None)
                log.exception("slot_write_failed", name=name, slot=job.slot)
                done = self._mark()  # (after whatever part of the copy was queued)
                job.error = e
            finally:
                if job.region is not None and self.pool is not None:
                    self.pool.unhold(job.region, done)  # reused once this copy completed
                job.issued.set()

    def _mark(self) -> Any:
        """An event after the work queued on the stream so far (None if even that fails)."""
        try:
            event = torch.cuda.Event()
            event.record(self.stream)
            return event
        except Exception:  # noqa: BLE001
            return None
