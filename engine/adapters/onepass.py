"""One pass per byte: an adapter's files read once, hashed as they are read, checked, packed
straight into its slot image and (optionally) written to the staging copy, all in that pass.

    config bytes -> hash, parse, config checks
    weights header (8 + n bytes) -> hash, structure + shape checks, the slot layout (a
        header checked before, byte for byte with the same config and base: its result)
    data section, in chunks of whole tensors (pass_chunks.py) -> hash (a thread of its own:
        hashlib drops the GIL on large buffers) and staging copy (another); meanwhile in the
        caller's thread: value checks of every tensor (NaN, Inf, bounds: checks.py) and the
        pack into the image
    end -> the digest (DESIGN.md's: digest.py) compared with every expected one

``defer_copy``: the staging copy is written after the pass, from the chunks the pass kept
(pass_chunks.py), and sealed once written (``PassResult.copy``, a future of its Seal): the
pass itself then only reads, hashes, checks and packs. On two cores the copy's write (~0.6 x
the hash time) would otherwise share them with the hash (1.0 x) and the checks and pack
(~1.1 x); nothing reads the copy before it is sealed (lifecycle.py waits for the future; an
adapter with DoRA magnitudes or modules_to_save tables, read from the copy right after the
pass, gets it written during the pass as before).

Each byte is read once into a private chunk buffer, so the hash, the checks, the image and
the copy see the same bytes even if the source changes meanwhile. Every failure raises its
typed error (AdapterDigestError, AdapterValueError, AdapterFormatError, ...) after the
hashing thread stopped; nothing the pass wrote is usable then: the caller gives the image's
memory back, and the copy is only renamed into place once the digest matched and every check
passed. Blocking: run it in a worker thread (``stop`` ends it between chunks).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.adapters.checks import (
    MAX_ADAPTER_WEIGHT,
    check_folded_values,
    check_weight_values,
)
from loraplex.engine.adapters.files import (
    CONFIG_FILE,
    DEFAULT_MAX_HEADER_BYTES,
    ITEMSIZE,
    TORCH_DTYPES,
    WEIGHTS_FILE,
    TensorEntry,
    header_length,
    parse_safetensors_header,
)
from loraplex.engine.adapters.pass_chunks import ChunkReader, pread_exact
from loraplex.engine.adapters.pass_sinks import Hasher, Packer
from loraplex.engine.adapters.peft_config import PeftLoRAConfig
from loraplex.engine.adapters.preflight import PreflightReport, check_config, check_header
from loraplex.engine.adapters.seal import Seal, seal_folder
from loraplex.engine.adapters.targets import base_module_name
from loraplex.engine.adapters.thread_jobs import StageStopped
from loraplex.engine.errors import AdapterTooLargeError
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.lora.slot_image import PackedAdapter

__all__ = ["PassResult", "PassSource", "read_pass"]


@dataclass
class PassSource:
    """The two files as open descriptors (read with ``os.pread``; the pass closes neither)
    and their sizes: a local source's, or the staging copy's."""

    config_fd: int
    weights_fd: int
    config_size: int
    weights_size: int

    @staticmethod
    def open_dir(folder: Path) -> PassSource:
        """The adapter files of a folder (the caller closes both: ``close``)."""
        cfd = os.open(folder / CONFIG_FILE, os.O_RDONLY | os.O_CLOEXEC)
        try:
            wfd = os.open(folder / WEIGHTS_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(cfd)
            raise
        return PassSource(cfd, wfd, os.fstat(cfd).st_size, os.fstat(wfd).st_size)

    def close(self) -> None:
        for fd in (self.config_fd, self.weights_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class PassResult:
    digest: str  # DESIGN.md's adapter digest ("" when the pass did not hash)
    config: PeftLoRAConfig
    report: PreflightReport
    packed: PackedAdapter | None  # the slot image (None: the pass only checked)
    nbytes: int  # both files
    header_s: float = 0.0  # seconds of the config and header checks, before any tensor byte
    seal: Seal | None = None  # the staging copy this pass wrote and verified, sealed (seal.py)
    copy: Future | None = None  # defer_copy: the copy still being written (its Seal, or error)


def read_pass(
    src: PassSource,
    model_config: ModelConfig,
    *,
    max_lora_rank: int,
    max_bytes: int | None,
    full_modules: bool = False,
    dtype: torch.dtype | None = None,
    pin: bool = False,
    out: torch.Tensor | None = None,
    copy_to: Path | None = None,
    expect: Callable[[str], None] | None = None,
    hash_bytes: bool = True,
    stop: threading.Event | None = None,
    sealed: Seal | None = None,
    defer_copy: bool = False,
) -> PassResult:
    """The pass (see the module docstring). ``dtype``: pack the slot image in this dtype (into
    ``out``, a host-pool region's view, else a new buffer, pinned if ``pin``); None: no image.
    ``copy_to``: a folder that gets both files (the weights only once everything passed);
    ``expect(digest)``: raises if the digest is not the expected one (before anything is
    usable); ``hash_bytes=False``: a re-read of the engine's own verified copy, whose
    ``sealed`` identity the open files must have before and after the pass (seal.py)."""
    total = src.config_size + src.weights_size
    if max_bytes is not None and total > max_bytes:
        raise AdapterTooLargeError(
            f"adapter files are {total} bytes ({WEIGHTS_FILE}: {src.weights_size}), above the "
            f"quota of {max_bytes}",
            field=WEIGHTS_FILE,
        )
    t0 = time.perf_counter()
    if sealed is not None:
        sealed.check_fds(src.config_fd, src.weights_fd, "the staged copy")
    hasher = (
        Hasher(copy_to, hash_bytes, src.weights_size) if hash_bytes or copy_to is not None else None
    )
    reader: ChunkReader | None = None
    ok = False
    try:
        raw_config = bytearray(src.config_size)
        pread_exact(src.config_fd, memoryview(raw_config), 0)
        config = check_config(bytes(raw_config), model_config, full_modules=full_modules)
        if copy_to is not None:
            (copy_to / CONFIG_FILE).write_bytes(raw_config)
        config_hex = hashlib.sha256(raw_config).hexdigest() if hash_bytes else ""
        prefix = bytearray(8)
        pread_exact(src.weights_fd, memoryview(prefix), 0)
        n = header_length(bytes(prefix), src.weights_size, DEFAULT_MAX_HEADER_BYTES)
        raw = bytearray(n)
        pread_exact(src.weights_fd, memoryview(raw), 8)
        key = (bytes(raw_config), bytes(raw), src.weights_size, max_lora_rank, full_modules)
        checked = _HEADERS.get(key, model_config)
        header = checked[0] if checked else parse_safetensors_header(key[1], src.weights_size)
        defer = (
            defer_copy and copy_to is not None and hash_bytes
            and not config.use_dora and not config.modules_to_save
        )  # fmt: skip
        reader = ChunkReader(src.weights_fd, 8 + n, header.tensors, hasher, retain=defer)
        if hasher is not None:
            head = bytes(prefix + raw)
            hasher.deferred = reader.retain
            reader.track(hasher.feed(head))
            if hasher.deferred:
                reader.track([hasher.write(head)])
        if checked is None:
            # the first chunks are read (and hashed, copied) while the header's checks run;
            # none of their bytes is checked or packed before those passed
            reader.prefetch()
            report = check_header(header, config, model_config, max_lora_rank, total)
            _HEADERS.put(key, model_config, (header, report))
        else:
            report = checked[1]
        header_s = time.perf_counter() - t0
        packer = Packer(report, config, max_lora_rank, dtype, pin, out) if dtype else None
        _data_pass(reader, report, config, model_config, packer, stop)
        if hasher is not None and hasher.deferred:
            weights_hex = hasher.finish_hash()
        else:
            reader.drain()  # a failed write of the copy
            weights_hex = hasher.finish() if hasher is not None else ""
        digest = ""
        if hash_bytes:
            text = f"{config_hex}  {CONFIG_FILE}\n{weights_hex}  {WEIGHTS_FILE}\n"
            digest = hashlib.sha256(text.encode()).hexdigest()
            if expect is not None:
                expect(digest)
        seal, copy = None, None
        if hasher is not None and hasher.deferred:
            assert copy_to is not None
            futures, release = reader.hand_off()
            copy = hasher.copy_later(futures, lambda: _seal(copy_to, digest), release)
        elif copy_to is not None:
            os.replace(copy_to / f".{WEIGHTS_FILE}.part", copy_to / WEIGHTS_FILE)
            seal = seal_folder(copy_to, digest) if digest else None
        if sealed is not None:  # what the pass read is what was verified
            sealed.check_fds(src.config_fd, src.weights_fd, "the staged copy")
        ok = True
        packed = packer.packed if packer else None
        return PassResult(digest, config, report, packed, total, header_s, seal, copy)
    finally:
        if hasher is not None:
            hasher.close(ok)  # (the threads stopped: nothing reads the ring any more)
        if reader is not None:
            reader.close()


def _seal(copy_to: Path, digest: str) -> Seal:
    """The copy's weights file renamed into place, both files sealed (seal.py)."""
    os.replace(copy_to / f".{WEIGHTS_FILE}.part", copy_to / WEIGHTS_FILE)
    return seal_folder(copy_to, digest)


class _HeaderMemo:
    """Headers that passed their checks, by the exact bytes they were checked from: the
    config's and the header's, the weights file's size, the rank limit, the base (the same
    object). Adapters of one base and shape have byte-identical headers (the same keys,
    shapes and offsets; only the data differs), so a load of the thousandth such adapter
    skips the header's parse and checks (~0.1-0.2 x the sha256 time of a 27-84 MB adapter):
    their result is a function of exactly these inputs. Thread-safe, last used kept."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: OrderedDict[tuple, tuple[ModelConfig, Any]] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: tuple, mc: ModelConfig) -> Any:
        with self.lock:
            got = self.items.get(key)
            if got is None or got[0] is not mc:
                return None
            self.items.move_to_end(key)
            return got[1]

    def put(self, key: tuple, mc: ModelConfig, value: Any) -> None:
        with self.lock:
            self.items[key] = (mc, value)
            self.items.move_to_end(key)
            while len(self.items) > self.size:
                self.items.popitem(last=False)


_HEADERS = _HeaderMemo(32)


@torch.no_grad()
def _data_pass(
    reader: ChunkReader,
    report: PreflightReport,
    config: PeftLoRAConfig,
    mc: ModelConfig,
    packer: Packer | None,
    stop: threading.Event | None,
) -> None:
    """Check and pack the data section chunk by chunk as the reader hands them over (each
    chunk is hashed and copied in the sinks' threads meanwhile: pass_chunks.py)."""
    roles = _roles(report, mc)
    scales = {key: config.scale_for(base_module_name(*key)) for key in report.modules}
    for i, run in enumerate(reader.runs):
        if stop is not None and stop.is_set():
            raise StageStopped("the adapter's load was cancelled")
        buf = reader.get(i)
        lo = run[0].begin
        checked = _chunk_within_bounds(buf, run, lo, roles, scales)
        if checked and packer is not None and _flat(packer, buf, run, lo, roles, scales):
            continue
        for t in run:
            role = roles.get(t.key)
            if role is None:
                continue  # PEFT's copies of base tables: never read (as the parser)
            x = buf[t.begin - lo : t.end - lo]
            if (t.begin - lo) % ITEMSIZE[t.dtype]:
                x = x.clone()  # not aligned in the buffer
            x = x.view(TORCH_DTYPES[t.dtype]).view(t.shape)
            what, key = role
            if checked:
                pass
            elif what == "B":
                check_folded_values(x, t.key, scales[key])
            elif what == "M":
                check_weight_values(x.float(), t.key)
            else:
                check_weight_values(x, t.key)
            if packer is not None and what in ("A", "B"):
                packer.put(key, what, x, scales[key])
    if packer is not None:
        packer.finish()


def _flat(
    packer: Packer,
    buf: torch.Tensor,
    run: list[TensorEntry],
    lo: int,
    roles: dict[str, tuple[str, Any]],
    scales: dict[tuple[int, str], float],
) -> bool:
    """A checked chunk of one dtype packed tensor by tensor as flat strided copies (the
    values are the ``put`` path's); False (nothing packed) where it does not apply."""
    dtype, size = TORCH_DTYPES[run[0].dtype], ITEMSIZE[run[0].dtype]
    if not packer.copies(dtype) or any((t.begin - lo) % size for t in run):
        return False
    src = buf.view(dtype)
    for t in run:
        role = roles.get(t.key)
        if role is not None and role[0] in ("A", "B"):
            packer.put_flat(role[1], role[0] == "A", src, (t.begin - lo) // size, scales[role[1]])
    return True


def _chunk_within_bounds(
    buf: torch.Tensor,
    run: list[TensorEntry],
    lo: int,
    roles: dict[str, tuple[str, Any]],
    scales: dict[tuple[int, str], float],
) -> bool:
    """Every tensor of the chunk passes its value check, found with one min/max pass over the
    chunk: true if the chunk is one dtype, aligned, and its largest magnitude times the
    largest LoRA scale of its B tensors is within the bound (rounding is monotonic, so each
    tensor's own check passes too). False: check tensor by tensor (and word the error)."""
    dtype = run[0].dtype
    if any(t.dtype != dtype for t in run) or len(buf) % ITEMSIZE[dtype]:
        return False
    if any(roles.get(t.key, ("", None))[0] == "M" for t in run):
        return False  # (checked in float32)
    s = max(
        [abs(scales[roles[t.key][1]]) for t in run if roles.get(t.key, ("",))[0] == "B"] + [1.0]
    )
    lo_hi = torch.aminmax(buf.view(TORCH_DTYPES[dtype]))
    peak = torch.maximum(lo_hi[0].float().abs(), lo_hi[1].float().abs())
    return bool(peak * s <= MAX_ADAPTER_WEIGHT)


def _roles(report: PreflightReport, mc: ModelConfig) -> dict[str, tuple[str, Any]]:
    """tensor key -> ("A" | "B", (layer, module)), ("M", key) for DoRA magnitudes, ("FULL",
    module) for modules_to_save tables: what the pass checks (and packs)."""
    roles: dict[str, tuple[str, Any]] = {}
    for key, m in report.modules.items():
        roles[m.a_key], roles[m.b_key] = ("A", key), ("B", key)
        if m.m_key is not None:
            roles[m.m_key] = ("M", key)
    for module, tkey in report.tables.items():
        roles[tkey] = ("FULL", module)
    return roles
