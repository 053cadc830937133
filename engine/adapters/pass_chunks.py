"""The data section of one pass (onepass.py) in chunks: runs of whole tensors, each read once
into a buffer of a small ring and handed to the sinks' threads (pass_sinks.Hasher: the hash,
the staging copy) while the pass's own thread checks and packs it.

The reader runs ahead of the checks: the pass asks for the first chunks right after the
header is parsed, so the hash thread is busy while the header's checks run. Nothing of a chunk
is checked or packed before those passed, and a failure stops the threads and drops the copy
they wrote (onepass.py). A buffer is read into again only once every thread that reads it is
done with it, so the hash, the checks, the image and the copy see the same bytes.

A pass that defers its staging copy (``retain=True``) keeps each chunk instead of reusing the
ring: the copy is written from the kept chunks after the pass (``hand_off``), so the pass
itself only reads, hashes, checks and packs. Up to ``RETAIN_BYTES`` of chunks are kept; past
that the oldest kept chunk is written first and its buffer reused (the copy catches up).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch

from loraplex.engine.adapters.files import WEIGHTS_FILE, TensorEntry
from loraplex.engine.errors import AdapterFormatError

__all__ = ["CHUNK_BYTES", "ChunkReader", "pread_exact", "runs_of"]

# a chunk holds whole tensors (one larger than this: its own chunk); small enough that the
# read, the hash and the checks of a chunk find it in the cache
CHUNK_BYTES = 2 << 20
# buffers per pass: the hash thread may run this many chunks ahead of the checks (the header's
# checks take ~0.1-0.2 x the hash time of the file: a few chunks of a 27-84 MB adapter)
RING = 6
KEEP_RINGS = 4  # rings kept for later passes (one per concurrent pass; new buffers page-fault)
_rings: list[list[torch.Tensor]] = []
_rings_lock = threading.Lock()
# chunks one pass that defers its copy keeps beyond its ring (an 84 MB adapter fits), kept
# for later such passes once written: reused buffers do not page-fault again
RETAIN_BYTES = 128 << 20
_spare: list[torch.Tensor] = []


def pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (the GIL is released during each read)."""
    done, n = 0, len(buf)
    while done < n:
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE}: short read at byte {offset + done} of the listed size (the "
                "file changed while it was read?)",
                field=WEIGHTS_FILE,
            )
        done += got


def runs_of(tensors: list[TensorEntry]) -> list[list[TensorEntry]]:
    """Runs of whole tensors in file order, each up to ``CHUNK_BYTES`` (or one tensor)."""
    out: list[list[TensorEntry]] = []
    cur: list[TensorEntry] = []
    size = 0
    for t in sorted(tensors, key=lambda t: t.begin):
        if cur and size + t.end - t.begin > CHUNK_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.end - t.begin
    if cur:
        out.append(cur)
    return out


def _take_ring(width: int) -> list[torch.Tensor]:
    """A ring of chunk buffers of at least ``width`` bytes: a kept one when the chunks are
    the usual size; an outsized tensor gets 2 to RING buffers of its own (not kept)."""
    if width <= CHUNK_BYTES:
        with _rings_lock:
            if _rings:
                return _rings.pop()
        return [torch.empty(CHUNK_BYTES, dtype=torch.uint8) for _ in range(RING)]
    count = max(2, min(RING, RING * CHUNK_BYTES // width))
    return [torch.empty(width, dtype=torch.uint8) for _ in range(count)]


def _give_ring(ring: list[torch.Tensor]) -> None:
    if len(ring) == RING and ring[0].numel() == CHUNK_BYTES:
        with _rings_lock:
            if len(_rings) < KEEP_RINGS:
                _rings.append(ring)


def _take_spare() -> torch.Tensor:
    with _rings_lock:
        if _spare:
            return _spare.pop()
    return torch.empty(CHUNK_BYTES, dtype=torch.uint8)


def _give_back(bufs: list[torch.Tensor]) -> None:
    """A retaining pass's buffers: its ring as a ring, the rest kept as spares (up to
    ``RETAIN_BYTES``)."""
    _give_ring(bufs[:RING])
    with _rings_lock:
        room = RETAIN_BYTES // CHUNK_BYTES - len(_spare)
        _spare.extend(bufs[RING:][: max(0, room)])


class ChunkReader:
    """Reads the runs of a weights file into a ring of buffers, feeding each to ``sink``
    (``feed(view) -> futures``: threads that read the buffer) as it is read. ``retain``: keep
    each run's buffer for the deferred copy (``sink.write(view) -> future``; module doc)."""

    def __init__(
        self, fd: int, base: int, tensors: list[TensorEntry], sink: Any, retain: bool = False
    ) -> None:
        self.fd, self.base, self.sink = fd, base, sink
        self.runs = runs_of(tensors)
        width = max((r[-1].end - r[0].begin for r in self.runs), default=0)
        self.bufs = _take_ring(width)
        # (outsized runs: their own ring, never kept)
        self.retain = retain and width <= CHUNK_BYTES and len(self.bufs) == RING
        self.views = [_view(b) for b in self.bufs]
        self.pending: list[list[Future]] = [[] for _ in self.bufs]
        self.other: list[Future] = []  # the sinks' work on bytes outside the ring (the header)
        self.count = 0  # runs read so far
        self.slot_of: list[int] = []  # run -> the buffer that holds (held) it
        self.held: deque[int] = deque()  # retain: runs kept, not yet handed to the copy

    def track(self, futures: list[Future]) -> None:
        self.other.extend(futures)

    def prefetch(self) -> None:
        """Read as many runs as the ring holds (never waits: every buffer is free)."""
        while self.count < min(len(self.runs), RING if self.retain else len(self.bufs)):
            self._read_next()

    def get(self, i: int) -> torch.Tensor:
        """Run ``i``'s bytes (runs are asked for in order): read now unless read ahead."""
        while self.count <= i:
            self._read_next()
        run = self.runs[i]
        return self.bufs[self.slot_of[i]][: run[-1].end - run[0].begin]

    def _free_slot(self) -> int:
        """A buffer to read the next run into, once every thread is done with what it held."""
        i = self.count
        if not self.retain:
            k = i % len(self.bufs)
        elif i < len(self.bufs) or len(self.bufs) * CHUNK_BYTES < RETAIN_BYTES:
            if i >= len(self.bufs):
                self.bufs.append(_take_spare())
                self.views.append(_view(self.bufs[-1]))
                self.pending.append([])
            k = i
        else:  # as many kept as allowed: the oldest is written first, its buffer reused
            j = self.held.popleft()
            k = self.slot_of[j]
            self.pending[k].append(self.sink.write(self._bytes(j)))
        for f in self.pending[k]:  # the threads are done with the run this buffer held
            f.result()
        self.pending[k] = []
        return k

    def _bytes(self, i: int) -> memoryview:
        run = self.runs[i]
        return self.views[self.slot_of[i]][: run[-1].end - run[0].begin]

    def _read_next(self) -> None:
        k = self._free_slot()
        self.slot_of.append(k)
        i = self.count
        run = self.runs[i]
        lo, hi = run[0].begin, run[-1].end
        pread_exact(self.fd, self.views[k][: hi - lo], self.base + lo)
        if self.sink is not None:
            self.pending[k] = self.sink.feed(self.views[k][: hi - lo])
        if self.retain:
            self.held.append(i)
        self.count += 1

    def drain(self) -> None:
        """Wait for every thread's work; its first error (a failed write of the copy)."""
        for f in self.other + [f for fs in self.pending for f in fs]:
            f.result()

    def hand_off(self) -> tuple[list[Future], Any]:
        """(retain, every run read) The kept runs handed to the copy, in file order: the
        futures of all the sinks' work, and ``give_back()`` for once they are done. The
        reader holds nothing after this."""
        assert self.retain and self.count == len(self.runs)
        while self.held:
            j = self.held.popleft()
            self.pending[self.slot_of[j]].append(self.sink.write(self._bytes(j)))
        futures = self.other + [f for fs in self.pending for f in fs]
        bufs = self.bufs
        self.bufs, self.views, self.pending, self.other = [], [], [], []
        return futures, lambda: _give_back(bufs)

    def close(self) -> None:
        """(After the sink's threads stopped.) Give the buffers back once nothing reads them."""
        for f in self.other + [f for fs in self.pending for f in fs]:
            with contextlib.suppress(BaseException):
                f.result()
        self.pending = [[] for _ in self.bufs]
        self.other = []
        if self.bufs:
            (_give_back if self.retain else _give_ring)(self.bufs)
        self.bufs = []


def _view(buf: torch.Tensor) -> memoryview:
    return memoryview((ctypes.c_char * buf.numel()).from_address(buf.data_ptr())).cast("B")
