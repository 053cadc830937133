"""Where one pass's bytes go (onepass.py): ``Packer`` writes each module's A and scaled B into
the slot image as the pass reaches them; ``Hasher`` hashes the weights file in order in a
thread of its own, which also writes the staging copy's ``.part`` file."""

from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.adapters.checks import fold_scale_into
from loraplex.engine.adapters.files import WEIGHTS_FILE
from loraplex.engine.adapters.peft_config import PeftLoRAConfig
from loraplex.engine.adapters.preflight import PreflightReport
from loraplex.engine.model.lora.slot_image import PackedAdapter, PackEntry, layout_of, new_buffer

__all__ = ["Hasher", "Packer"]


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
        # (they lie back to back) instead of one per module, once the layer is complete
        self.unscaled: dict[int, list[tuple[PackEntry, float]]] = {}

    @torch.no_grad()
    def put(self, key: tuple[int, str], what: str, x: torch.Tensor, scale: float) -> None:
        e = self.packed.entries[key]
        if what == "A":
            self.packed.a(e).copy_(x)
        elif x.dtype == self.dtype or self.dtype == torch.float32:
            # fold_scale_into's exact form (copy, then one float32 product), the product later
            self.packed.b(e).t().copy_(x.t())
            self.unscaled.setdefault(e.layer, []).append((e, scale))
        else:
            fold_scale_into(self.packed.b(e), x, scale)

    @torch.no_grad()
    def finish(self) -> None:
        """Every B block scaled: per layer one product when its modules share the scale and
        their blocks are contiguous, else one per module (the same values either way)."""
        buf = self.packed.buffer
        for blocks in self.unscaled.values():
            blocks.sort(key=lambda es: es[0].b_offset)
            scale = blocks[0][1]
            spans = [(e.b_offset, e.b_offset + e.rows * e.out_features) for e, _ in blocks]
            joined = all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            if joined and all(s == scale for _, s in blocks):
                if scale != 1.0:
                    buf[spans[0][0] : spans[-1][1]].mul_(scale)
                continue
            for (_e, s), (b0, b1) in zip(blocks, spans, strict=True):
                if s != 1.0:
                    buf[b0:b1].mul_(s)
        self.unscaled.clear()


class Hasher:
    """sha256 of the weights file, fed in order by one thread of its own, which also writes
    the staging copy's ``.part`` file."""

    def __init__(self, copy_to: Path | None) -> None:
        self.h = hashlib.sha256()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-hash")
        self.part = copy_to / f".{WEIGHTS_FILE}.part" if copy_to is not None else None
        self.fd = (
            os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            if self.part is not None
            else None
        )

    def feed(self, data: Any, hash_bytes: bool) -> Future:
        return self.pool.submit(self._take, data, hash_bytes)

    def _take(self, data: Any, hash_bytes: bool) -> None:
        if hash_bytes:
            self.h.update(data)
        if self.fd is not None:
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(self.fd, view[done:])

    def finish(self) -> str:
        self.pool.shutdown(wait=True)
        return self.h.hexdigest()

    def close(self, ok: bool) -> None:
        """Stop the thread (after what it runs now: it may read a chunk buffer) and, unless
        the pass succeeded, remove the partial copy."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            if not ok and self.part is not None:
                with contextlib.suppress(OSError):
                    self.part.unlink()
