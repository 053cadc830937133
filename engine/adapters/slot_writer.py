"""The slot writer: GPU slot writes issued from their own thread, in paced chunks.

Why: issued from the step thread, each 84 MB slot write holds up the launch of the next step,
and queued whole it keeps the copy engine busy for milliseconds, so the next decode step's
few-KB input copy waits behind it: steps with writes in flight took 17-45 ms instead of 6.
Here a write

- waits (on the side stream) for the step in flight when that step may still read the slot's
  old contents (the executor passes its event only then; the scheduler hands out only slots
  no running request reads), else starts at once, overlapping it;
- moves the packed image host -> device in ``chunk_bytes`` pieces, each issued only once the
  previous one has landed (the thread sleeps meanwhile, without the GIL): a step's input copy
  waits behind at most one chunk;
- then scatters it into the slot on the side stream and records the event the engine polls.

Only ``submit`` and ``close`` are called from other threads.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import structlog
import torch

from loraplex.engine.model.lora.slot_buffers import write_slot

__all__ = ["SlotWriter"]

log = structlog.get_logger("loraplex.engine")


class SlotWriter:
    def __init__(
        self,
        model: Any,
        stream: torch.cuda.Stream,
        chunk_bytes: int = 8 << 20,
    ) -> None:
        self.model = model
        self.stream = stream
        self.chunk_bytes = chunk_bytes
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="loraplex-slot-writer", daemon=True)
        self._thread.start()

    def submit(
        self, v: Any, slot: int, adapter: Any, after: Any, *, paced: bool = True
    ) -> threading.Event:
        """Write ``adapter`` into ``slot`` for version ``v`` once the step whose event is
        ``after`` (None: none) has completed; sets ``v.slot_event`` when issued. ``paced``
        False: one host -> device copy (a step that waits for this write anyway gains nothing
        from pacing). Returns an event set once the write is issued (or has failed: then
        ``v.slot_event`` stays None)."""
        if not self._thread.is_alive():  # fail the step loudly rather than wait forever
            raise RuntimeError("the slot writer thread is not running")
        issued = threading.Event()
        self._jobs.put((v, slot, adapter, after, paced, issued))
        return issued

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def _pace(self, event: torch.cuda.Event) -> None:
        while not event.query():
            time.sleep(5e-5)

    def _run(self) -> None:
        torch.cuda.set_device(self.stream.device)  # (a torch.device with its index)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            v, slot, adapter, after, paced, issued = job
            try:
                with torch.cuda.stream(self.stream):
                    if after is not None:
                        self.stream.wait_event(after)
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(self.stream)
                    copied = torch.cuda.Event(enable_timing=True)
                    write_slot(
                        self.model, slot, adapter, h2d_done=copied,
                        chunk_bytes=self.chunk_bytes if paced else None,
                        pace=self._pace if paced else None,
                    )  # fmt: skip
                    event = torch.cuda.Event(enable_timing=True)
                    event.record(self.stream)
                v.slot_timing = (start, copied)
                v.region_event = event  # the host-pool region is reused after this copy
                v.slot_event = event  # NOTE: set last: the loop polls it
            except Exception:  # noqa: BLE001 - a failed write must not kill the thread
                log.exception("slot_write_failed", name=getattr(v, "name", None), slot=slot)
            finally:
                issued.set()
