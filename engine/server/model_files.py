"""The files of a base model the engine reads, their safetensors headers, and the typed errors
of getting a base model from its source (``model_source.py``, ``model_hub.py``, ``model_s3.py``).

A served model folder holds ``config.json``, safetensors weights (one file, or shards named by
``model.safetensors.index.json``) and optionally the tokenizer and chat-template files. Nothing
else is fetched from a remote source: no pickled weights (``*.bin``, ``*.pt``), no code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "META_FILES",
    "ModelSourceError",
    "ModelNotFoundError",
    "ModelAccessError",
    "ModelFormatError",
    "ModelOfflineError",
    "ModelNetworkError",
    "TensorMeta",
    "ModelMetadata",
    "plan_files",
    "weight_files",
    "check_model_dir",
    "parse_header",
    "header_length",
    "local_metadata",
    "metadata_from",
    "read_json",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
# read by the engine besides the weights (model/config.py, tokenizer.py), fetched where present
META_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
MAX_HEADER_BYTES = 100 << 20  # a safetensors header: ~150 B per tensor
MAX_JSON_BYTES = 16 << 20
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelSourceError(ValueError):
    """The base model cannot be had from its source (a configuration error of ``serve``)."""


class ModelNotFoundError(ModelSourceError):
    """No such folder, Hub repository, revision or S3 prefix."""


class ModelAccessError(ModelSourceError):
    """The source refused access (HTTP 401 / 403, a gated Hub repository)."""


class ModelFormatError(ModelSourceError):
    """The source holds no servable model (no config.json, no safetensors weights)."""


class ModelOfflineError(ModelSourceError):
    """Offline (HF_HUB_OFFLINE) and the model is not in the local cache."""


class ModelNetworkError(ModelSourceError):
    """The source could not be reached (connection, timeout, server error)."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # safetensors dtype: BF16, F16, F32, F8_E4M3, ...
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelMetadata:
    """What the memory estimate reads: config.json and every weight tensor's header entry."""

    where: str  # the folder, or the pinned remote source (hf://org/repo@<sha>, s3://...)
    config: dict[str, Any]
    tensors: list[TensorMeta]
    files: int  # safetensors files


def weight_files(names: Collection[str], read_index: Callable[[], Any], where: str) -> list[str]:
    """The safetensors files to serve among ``names`` (a folder's file names): the index and
    the shards it names, else every ``*.safetensors`` (``model.safetensors`` alone if present;
    Mistral's ``consolidated*`` files are another layout). ``read_index()`` returns the parsed
    index. ModelFormatError when there are none."""
    if INDEX_FILE in names:
        index = read_index()
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise ModelFormatError(f"{where}: {INDEX_FILE} has no weight_map")
        shards = sorted({str(v) for v in wmap.values()})
        bad = [s for s in shards if "/" in s or "\\" in s or not s.endswith(".safetensors")]
        if bad:
            raise ModelFormatError(f"{where}: {INDEX_FILE} names unusable shard files {bad[:3]}")
        missing = [s for s in shards if s not in names]
        if missing:
            raise ModelFormatError(f"{where}: {INDEX_FILE} names missing shards {missing[:3]}")
        return [INDEX_FILE, *shards]
    if "model.safetensors" in names:
        return ["model.safetensors"]
    found = sorted(
        n for n in names if n.endswith(".safetensors") and not n.startswith("consolidated")
    )
    if not found:
        pickles = sorted(n for n in names if n.endswith(_PICKLES))
        also = f" (it has {', '.join(pickles[:3])})" if pickles else ""
        raise ModelFormatError(
            f"{where} has no safetensors weights{also}: only safetensors checkpoints are served"
        )
    return found


def plan_files(names: Collection[str], read_index: Callable[[], Any], where: str) -> list[str]:
    """Every file to fetch from a remote folder holding ``names``: config.json first, the other
    metadata files it has, then the weights (``weight_files``)."""
    if CONFIG_FILE not in names:
        raise ModelFormatError(f"{where} has no {CONFIG_FILE}: not a transformers model")
    meta = [n for n in META_FILES if n in names]
    return [*meta, *weight_files(names, read_index, where)]


def read_json(path: Path) -> Any:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ModelFormatError(f"{path} is larger than {MAX_JSON_BYTES} bytes")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from None


def check_model_dir(path: Path) -> list[Path]:
    """A local model folder's weight files as the loader reads them (the shards its index
    names, else every ``*.safetensors``); ModelFormatError if config.json or a weight file is
    missing (a broken link of a partial Hub snapshot counts as missing)."""
    if not (path / CONFIG_FILE).is_file():
        raise ModelFormatError(f"{path} has no {CONFIG_FILE}")
    names = {p.name for p in path.iterdir() if p.is_file()}
    if INDEX_FILE in names:
        files = weight_files(names, lambda: read_json(path / INDEX_FILE), str(path))[1:]
    else:
        files = sorted(n for n in names if n.endswith(".safetensors"))
        if not files:
            weight_files(names, dict, str(path))  # raises, naming any pickled weights
    return [path / f for f in files]


def header_length(first8: bytes, where: str) -> int:
    """The JSON header's length from a safetensors file's first 8 bytes."""
    if len(first8) < 8:
        raise ModelFormatError(f"{where}: too short for a safetensors file")
    n = int.from_bytes(first8[:8], "little")
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise ModelFormatError(f"{where}: safetensors header length {n} is out of range")
    return n


def parse_header(raw: bytes, where: str) -> list[TensorMeta]:
    """The tensors of a safetensors JSON header (``__metadata__`` left out)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFormatError(f"{where}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ModelFormatError(f"{where}: safetensors header is not a JSON object")
    out = []
    for key, v in obj.items():
        if key == "__metadata__":
            continue
        try:
            shape = tuple(int(d) for d in v["shape"])
            begin, end = (int(o) for o in v["data_offsets"])
            out.append(TensorMeta(key, str(v["dtype"]), shape, end - begin))
        except (KeyError, TypeError, ValueError):
            raise ModelFormatError(f"{where}: bad header entry for tensor {key!r}") from None
    return out


def _file_header(path: Path) -> list[TensorMeta]:
    with open(path, "rb") as f:
        n = header_length(f.read(8), str(path))
        raw = f.read(n)
    if len(raw) != n:
        raise ModelFormatError(f"{path}: truncated safetensors header")
    return parse_header(raw, str(path))


def local_metadata(path: Path) -> ModelMetadata:
    """config.json and the weight headers of a local model folder (no tensor data is read)."""
    files = check_model_dir(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFormatError(f"{path / CONFIG_FILE} is not valid JSON: {e}") from None
    tensors = [t for f in files for t in _file_header(f)]
    return ModelMetadata(str(path), config, tensors, len(files))


def metadata_from(
    where: str, config: Any, headers: Mapping[str, list[TensorMeta]]
) -> ModelMetadata:
    if not isinstance(config, dict):
        raise ModelFormatError(f"{where}: {CONFIG_FILE} is not a JSON object")
    tensors = [t for name in sorted(headers) for t in headers[name]]
    return ModelMetadata(where, config, tensors, len(headers))
