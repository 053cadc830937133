"""Where one pass's bytes go (onepass.py): ``Packer`` writes each module's A and scaled B into
the slot image as the pass reaches them; ``Hasher`` hashes the weights file in order in a
thread of its own and writes the staging copy's ``.part`` file in another."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from loraplex.engine.adapters.checks import fold_scale_into
from loraplex.engine.adapters.files import WEIGHTS_FILE
from loraplex.engine.adapters.peft_config import PeftLoRAConfig
from loraplex.engine.adapters.preflight import PreflightReport
from loraplex.engine.model.lora.slot_image import PackedAdapter, PackEntry, layout_of, new_buffer

__all__ = ["Hasher", "Packer"]

_WORDS = {2: torch.int16, 4: torch.int32}  # element size -> a numpy-viewable type of that width


def _storage_words(t: torch.Tensor, word: torch.dtype) -> np.ndarray:
    """The whole storage of ``t`` (from element 0: storage offsets index it) as numpy words."""
    base = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return base.view(word).numpy()


T = TypeVar("T")


class Packer:
    """Writes each module's A and scaled B into the slot image as the pass reaches them."""

    def __init__(
        self,
        report: PreflightReport,
        config: PeftLoRAConfig,
        max_rank: int,
        dtype: torch.dtype,
        pin: bool,
        out: torch.Tensor | None,
    ) -> None:
        dims = {key: (m.rank, *m.in_out, m.experts) for key, m in report.modules.items()}
        entries, numel = layout_of(dims, max_rank)
        self.packed = PackedAdapter(new_buffer(numel, dtype, pin, out), entries, max_rank)
        self.dtype = dtype
        # B blocks copied but not scaled yet, by layer: one product over a layer's B blocks
        # (they lie back to back) instead of one per module, as soon as the layer is complete
        # (its blocks are still in the cache then: the file holds a layer's tensors together)
        self.unscaled: dict[int, list[tuple[PackEntry, float]]] = {}
        self.modules: dict[int, int] = {}  # layer -> its modules' count
        for e in entries.values():
            self.modules[e.layer] = self.modules.get(e.layer, 0) + 1
        self._buf_words: np.ndarray | None = None  # put_flat's numpy views (_words)
        self._src_key: tuple | None = None
        self._src_words: np.ndarray | None = None

    @torch.no_grad()
    def put(self, key: tuple[int, str], what: str, x: torch.Tensor, scale: float) -> None:
        e = self.packed.entries[key]
        if what == "A":
            self.packed.a(e).copy_(x)
        elif self.copies(x.dtype):
            # fold_scale_into's exact form (copy, then one float32 product), the product once
            # the layer's B blocks are all in
            self.packed.b(e).t().copy_(x.t())
            self._scale_later(e, scale)
        else:
            fold_scale_into(self.packed.b(e), x, scale)

    def copies(self, dtype: torch.dtype) -> bool:
        """B blocks of ``dtype`` are copied, then scaled by layer (else folded one by one)."""
        return dtype == self.dtype or self.dtype == torch.float32

    def put_flat(
        self, key: tuple[int, str], is_a: bool, src: torch.Tensor, start: int, scale: float
    ) -> None:
        """``put`` of a tensor that lies at element ``start`` of the flat ``src`` (a chunk
        of one dtype, ``copies`` true for it, ``no_grad``): one strided copy, no views of its
        shape (a pass copies ~250-450 such tensors per adapter: their Python cost counts)."""
        e = self.packed.entries[key]
        buf = self.packed.buffer
        rows, out = e.rows, e.out_features
        at = src.storage_offset() + start
        words = self._words(src) if src.dtype == buf.dtype else None
        if is_a:
            n, lo = rows * e.in_features, buf.storage_offset() + e.a_offset
            if words is not None:
                words[1][lo : lo + n] = words[0][at : at + n]
            else:
                buf.as_strided((n,), (1,), lo).copy_(src.as_strided((n,), (1,), at))
            return
        # B (out, rows) in the file, B^T (rows, out) in the image
        n, lo = rows * out, buf.storage_offset() + e.b_offset
        if words is not None:
            # the same bits transposed: numpy's transpose copy of a narrow (out, 16) matrix
            # is ~2.7 x torch's strided copy (~20 against ~55 us at out 4096, CPU)
            np.copyto(
                words[1][lo : lo + n].reshape(rows, out),
                words[0][at : at + n].reshape(out, rows).T,
            )
        else:
            buf.as_strided((rows, out), (out, 1), lo).copy_(
                src.as_strided((rows, out), (1, rows), at)
            )
        self._scale_later(e, scale)

    def _words(self, src: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
        """(the chunk's storage, the image's storage) as numpy words of their element width,
        for copies of the same dtype (None: a width numpy has no word for); the chunk's view
        kept while the pass stays on it."""
        word = _WORDS.get(src.element_size())
        if word is None:
            return None
        key = (src.untyped_storage().data_ptr(), src.dtype)
        if self._src_key != key:
            self._src_key, self._src_words = key, _storage_words(src, word)
        if self._buf_words is None:
            self._buf_words = _storage_words(self.packed.buffer, word)
        return self._src_words, self._buf_words

    def _scale_later(self, e: PackEntry, scale: float) -> None:
        blocks = self.unscaled.setdefault(e.layer, [])
        blocks.append((e, scale))
        if len(blocks) == self.modules[e.layer]:
            self._scale(self.unscaled.pop(e.layer))

    @torch.no_grad()
    def finish(self) -> None:
        """Every B block scaled (those of layers not complete yet: none in a full pass)."""
        for blocks in self.unscaled.values():
            self._scale(blocks)
        self.unscaled.clear()

    def _scale(self, blocks: list[tuple[PackEntry, float]]) -> None:
        """One layer's B blocks scaled: one product when its modules share the scale and their
        blocks are contiguous, else one per module (the same values either way)."""
        buf = self.packed.buffer
        blocks.sort(key=lambda es: es[0].b_offset)
        scale = blocks[0][1]
        spans = [(e.b_offset, e.b_offset + e.rows * e.out_features) for e, _ in blocks]
        joined = all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        if joined and all(s == scale for _, s in blocks):
            if scale != 1.0:
                buf[spans[0][0] : spans[-1][1]].mul_(scale)
            return
        for (_e, s), (b0, b1) in zip(blocks, spans, strict=True):
            if s != 1.0:
                buf[b0:b1].mul_(s)


class Hasher:
    """sha256 of the weights file, fed in order to one thread of its own; the staging copy's
    ``.part`` file (``size`` bytes, reserved up front) is written by a second thread. The hash is the floor of the pass: its
    thread does nothing else, and the copy's write (~0.5 x the hash time into the page cache)
    runs beside it and the checks and pack (the OS shares the cores among the three).

    ``deferred``: ``feed`` only hashes; the copy is written by ``write`` calls after the pass
    (onepass.py: the copy's write then costs the pass nothing on a machine of two cores)."""

    def __init__(self, copy_to: Path | None, hash_bytes: bool, size: int = 0) -> None:
        self.h = hashlib.sha256()
        self.hash_bytes = hash_bytes
        self.deferred = False
        self.pool = (
            ThreadPoolExecutor(1, thread_name_prefix="loraplex-hash") if hash_bytes else None
        )
        self.part = copy_to / f".{WEIGHTS_FILE}.part" if copy_to is not None else None
        self.fd: int | None = None
        self.writer: ThreadPoolExecutor | None = None
        if self.part is not None:
            self.fd = os.open(
                self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
            )
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="loraplex-copy")
            _reserve(self.fd, size)

    def feed(self, data: Any) -> list[Future]:
        """Hash and (unless deferred) copy ``data`` (each in its thread); the futures."""
        out = []
        if self.pool is not None:
            out.append(self.pool.submit(self.h.update, data))
        if self.writer is not None and not self.deferred:
            out.append(self.writer.submit(_write, self.fd, data))
        return out

    def write(self, data: Any) -> Future:
        """Append ``data`` to the copy (in the copy's thread, in the order of the calls)."""
        assert self.writer is not None and self.fd is not None
        return self.writer.submit(_write, self.fd, data)

    def finish(self) -> str:
        for pool in (self.pool, self.writer):
            if pool is not None:
                pool.shutdown(wait=True)
        return self.h.hexdigest() if self.hash_bytes else ""

    def finish_hash(self) -> str:
        """(deferred) The digest, once the hash thread is done; the copy's writes go on."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        return self.h.hexdigest() if self.hash_bytes else ""

    def copy_later(
        self, futures: list[Future], done: Callable[[], T], release: Callable[[], None]
    ) -> Future[T]:
        """(deferred) Once every write queued so far (and ``futures``) is done: the copy
        closed, then ``done()`` (rename and seal), in the copy's thread; its result or error
        is the returned future's. A failed write removes the ``.part`` file. ``release()``
        last, either way (the chunk buffers the writes read)."""
        assert self.writer is not None and self.fd is not None
        fd, part, self.fd = self.fd, self.part, None

        def complete() -> T:
            try:
                try:
                    for f in futures:  # (done: the thread runs its work in order)
                        f.result()
                finally:
                    os.close(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    part.unlink()  # type: ignore[union-attr]
                raise
            finally:
                release()
            return done()

        fut = self.writer.submit(complete)
        self.writer.shutdown(wait=False)  # (its thread ends after the copy)
        return fut

    def close(self, ok: bool) -> None:
        """Stop the threads (after what they run now: they may read a chunk buffer) and,
        unless the pass succeeded, remove the partial copy."""
        for pool in (self.pool, self.writer):
            if pool is not None and (pool is not self.writer or self.fd is not None):
                pool.shutdown(wait=True, cancel_futures=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            if not ok and self.part is not None:
                with contextlib.suppress(OSError):
                    self.part.unlink()


def _write(fd: int, data: Any) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])


def _reserve(fd: int, size: int) -> None:
    """Allocate the copy's ``size`` bytes up front (fallocate(2), mode 0): ext4 and xfs then
    skip the delayed allocation of a growing file page by page, which made the copy's writes
    cost ~20 % more CPU. A filesystem without it: nothing (not glibc's posix_fallocate, which
    would write zeros over the whole file instead)."""
    if size <= 0 or _fallocate is None:
        return
    _fallocate(fd, 0, 0, size)  # (an error: nothing reserved, the writes allocate)


def _libc_fallocate() -> Any:
    try:
        f = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    f.restype = ctypes.c_int
    return f


_fallocate = _libc_fallocate()
