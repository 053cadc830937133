"""The data section of one pass (onepass.py) in chunks: runs of whole tensors, each read once
into a buffer of a small ring and handed to the sinks' threads (pass_sinks.Hasher: the hash,
the staging copy) while the pass's own thread checks and packs it.

The reader runs ahead of the checks: the pass asks for the first chunks right after the
header is parsed, so the hash thread is busy while the header's checks run. Nothing of a chunk
is checked or packed before those passed, and a failure stops the threads and drops the copy
they wrote (onepass.py). A buffer is read into again only once every thread that reads it is
done with it, so the hash, the checks, the image and the copy see the same bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
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
_KEEP = 4  # rings kept for later passes (one per concurrent pass; new buffers page-fault)
_rings: list[list[torch.Tensor]] = []
_rings_lock = threading.Lock()


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
            if len(_rings) < _KEEP:
                _rings.append(ring)


class ChunkReader:
    """Reads the runs of a weights file into a ring of buffers, feeding each to ``sink``
    (``feed(view) -> futures``: threads that read the buffer) as it is read."""

    def __init__(self, fd: int, base: int, tensors: list[TensorEntry], sink: Any) -> None:
        self.fd, self.base, self.sink = fd, base, sink
        self.runs = runs_of(tensors)
        width = max((r[-1].end - r[0].begin for r in self.runs), default=0)
        self.bufs = _take_ring(width)
        self.views = [memoryview((ctypes.c_char * b.numel()).from_address(b.data_ptr())).cast("B")
                      for b in self.bufs]  # fmt: skip
        self.pending: list[list[Future]] = [[] for _ in self.bufs]
        self.other: list[Future] = []  # the sinks' work on bytes outside the ring (the header)
        self.count = 0  # runs read so far

    def track(self, futures: list[Future]) -> None:
        self.other.extend(futures)

    def prefetch(self) -> None:
        """Read as many runs as the ring holds (never waits: every buffer is free)."""
        while self.count < min(len(self.runs), len(self.bufs)):
            self._read_next()

    def get(self, i: int) -> torch.Tensor:
        """Run ``i``'s bytes (runs are asked for in order): read now unless read ahead."""
        while self.count <= i:
            self._read_next()
        run = self.runs[i]
        return self.bufs[i % len(self.bufs)][: run[-1].end - run[0].begin]

    def _read_next(self) -> None:
        i = self.count
        k = i % len(self.bufs)
        for f in self.pending[k]:  # the threads are done with the run this buffer held
            f.result()
        self.pending[k] = []
        run = self.runs[i]
        lo, hi = run[0].begin, run[-1].end
        pread_exact(self.fd, self.views[k][: hi - lo], self.base + lo)
        if self.sink is not None:
            self.pending[k] = self.sink.feed(self.views[k][: hi - lo])
        self.count += 1

    def drain(self) -> None:
        """Wait for every thread's work; its first error (a failed write of the copy)."""
        for f in self.other + [f for fs in self.pending for f in fs]:
            f.result()

    def close(self) -> None:
        """(After the sink's threads stopped.) Give the ring back once nothing reads it."""
        for f in self.other + [f for fs in self.pending for f in fs]:
            with contextlib.suppress(BaseException):
                f.result()
        self.pending = [[] for _ in self.bufs]
        self.other = []
        _give_ring(self.bufs)
