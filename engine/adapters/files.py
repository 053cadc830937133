"""The two files of a PEFT adapter, and the header of its safetensors file.

``read_safetensors_header`` reads only the header (8-byte little-endian length, then JSON) and
checks its structure: a length limit, known dtypes, shapes whose bytes match their data
offsets, and tensors that tile the data section exactly (no gap, no overlap, nothing
trailing). Every refusal is an ``AdapterFormatError`` (``AdapterShapeError`` for a dtype the
engine does not serve) naming the tensor.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.errors import AdapterFormatError, AdapterShapeError

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "ITEMSIZE",
    "DEFAULT_MAX_HEADER_BYTES",
    "TensorEntry",
    "SafetensorsHeader",
    "read_safetensors_header",
    "header_length",
    "parse_safetensors_header",
    "FileTensors",
    "TORCH_DTYPES",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_HEADER_BYTES = 8 << 20  # ~150 B per tensor: room for 50k tensors
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}  # the dtypes an adapter may use, in bytes
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # data_offsets, relative to the data section
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: list[TensorEntry]
    header_bytes: int  # the JSON's length (the file has 8 more bytes before it)
    data_bytes: int


def read_safetensors_header(path: Path, *, max_header_bytes: int) -> SafetensorsHeader:
    """Read and check only the header; the tensors must tile the data section exactly."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size, max_header_bytes)
        raw = f.read(n)
    return parse_safetensors_header(raw, size)


def header_length(prefix: bytes, size: int, max_header_bytes: int) -> int:
    """The header's length from the file's first 8 bytes (``size``: the file's), checked."""
    n = int.from_bytes(prefix.ljust(8, b"\0"), "little") if size >= 8 else -1
    if n > max_header_bytes:
        raise _fmt(f"header length {n} is above the limit of {max_header_bytes} bytes")
    if n < 2 or 8 + n > size:
        raise _fmt(f"file of {size} bytes is too short for its header (truncated?)")
    return n


def parse_safetensors_header(raw: bytes, size: int) -> SafetensorsHeader:
    """The checks of ``read_safetensors_header`` on a header already read: ``raw`` is the JSON
    (``header_length`` bytes after the first 8), ``size`` the whole file's length."""
    n = len(raw)
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except RecursionError:
        raise _fmt("header is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _fmt(f"header is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise _fmt("header is not a JSON object")
    data_bytes = size - 8 - n
    tensors = [_entry(k, v, data_bytes) for k, v in obj.items() if k != "__metadata__"]
    meta = obj.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fmt("__metadata__ must map strings to strings", field="__metadata__")
    pos, prev = 0, None
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if t.begin > pos:
            raise _fmt(f"gap of {t.begin - pos} bytes before tensor {t.key!r}", field=t.key)
        if t.begin < pos:
            raise _fmt(f"tensor {t.key!r} overlaps tensor {prev!r}", field=t.key)
        pos, prev = t.end, t.key
    if pos != data_bytes:
        raise _fmt(f"data section has {data_bytes} bytes but tensors cover {pos} (trailing gap)")
    return SafetensorsHeader(tensors=tensors, header_bytes=n, data_bytes=data_bytes)


def _entry(key: str, v: Any, data_bytes: int) -> TensorEntry:
    if not isinstance(v, dict):
        raise _fmt(f"header entry {key!r} is not an object", field=key)
    dtype, shape, offs = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _fmt(f"tensor {key!r} has no valid shape (got {shape!r})", field=key)
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_uint(o) for o in offs):
        raise _fmt(f"tensor {key!r} has no valid data_offsets (got {offs!r})", field=key)
    if dtype not in ITEMSIZE:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {key!r} has dtype {dtype!r}; only {', '.join(ITEMSIZE)} "
            "are supported",
            field=key,
        )
    begin, end = offs
    if begin > end or end > data_bytes:
        raise _fmt(
            f"tensor {key!r} data_offsets {offs} fall outside the data section of {data_bytes} "
            "bytes (truncated?)",
            field=key,
        )
    need = math.prod(shape) * ITEMSIZE[dtype]
    if end - begin != need:
        raise _fmt(
            f"tensor {key!r} spans {end - begin} bytes, but shape {tuple(shape)} of {dtype} "
            f"needs {need}",
            field=key,
        )
    return TensorEntry(key, dtype, tuple(shape), begin, end)


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _fmt(msg: str, *, field: str = WEIGHTS_FILE) -> AdapterFormatError:
    return AdapterFormatError(f"{WEIGHTS_FILE}: {msg}", field=field)


class FileTensors:
    """The named tensors of a checked safetensors file (``read_safetensors_header`` has checked
    that every tensor lies inside the data section), read into one buffer with one read per run
    of adjacent tensors; tensors are views of that buffer (they keep it alive). Other tensors
    (e.g. a modules_to_save table) are not read."""

    def __init__(self, path: Path, header: SafetensorsHeader, keys: list[str]) -> None:
        every = {t.key: t for t in header.tensors}
        wanted = sorted((every[k] for k in keys), key=lambda t: t.begin)
        total = sum(t.end - t.begin for t in wanted)
        # a torch allocation, not a bytearray: no zero-fill pass before the read
        self.buf = torch.empty(total, dtype=torch.uint8)
        raw = memoryview((ctypes.c_char * total).from_address(self.buf.data_ptr())).cast("B")
        self.at: dict[str, tuple[TensorEntry, int]] = {}
        base, pos = 8 + header.header_bytes, 0
        with open(path, "rb") as fh:
            i = 0
            while i < len(wanted):
                j, start = i, pos
                while j + 1 < len(wanted) and wanted[j + 1].begin == wanted[j].end:
                    j += 1
                for t in wanted[i : j + 1]:
                    self.at[t.key] = (t, pos)
                    pos += t.end - t.begin
                fh.seek(base + wanted[i].begin)
                got = fh.readinto(raw[start:pos])
                if got != pos - start:
                    raise OSError(f"short read: {got} of {pos - start} bytes (file changed?)")
                i = j + 1

    def __getitem__(self, key: str) -> torch.Tensor:
        t, pos = self.at[key]
        raw = self.buf[pos : pos + t.end - t.begin]
        if pos % ITEMSIZE[t.dtype]:  # not aligned in the buffer: its own (aligned) copy
            raw = raw.clone()
        return raw.view(TORCH_DTYPES[t.dtype]).view(t.shape)
