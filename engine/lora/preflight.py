"""Check an adapter folder before any tensor data is read.

Reads ``adapter_config.json`` and only the header of ``adapter_model.safetensors`` (8-byte
little-endian length, then JSON). It checks the header's structure (length limit, dtypes,
shapes, offsets that tile the data section exactly) and the adapter against the base model
(targets, ranks, A ``(r, in)`` / B ``(out, r)`` shapes) and the byte quota. Blocking: run it
in a worker thread.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.engine.lora.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterTooLargeError,
)
from loraplex.engine.lora.peft_config import PeftLoRAConfig, parse_peft_config_json
from loraplex.engine.lora.targets import base_module_name, check_targets, vocab_module
from loraplex.engine.model.config import (
    LORA_MODULES,
    VOCAB_LAYER,
    VOCAB_LORA_MODULES,
    ModelConfig,
)

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "ModuleReport",
    "PreflightReport",
    "SafetensorsHeader",
    "TensorEntry",
    "preflight",
    "read_safetensors_header",
    "check_dora_pair",
    "check_full_modules_allowed",
    "check_added_rows",
    "check_full_table",
    "check_table_copy",
    "is_table_copy",
    "check_full_tables_present",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
DEFAULT_MAX_HEADER_BYTES = 8 << 20  # ~150 B per tensor: room for 50k tensors
MAX_CONFIG_BYTES = 1 << 20
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_KEY_RE = re.compile(
    r"(?P<module>.+?)\.(?:lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight"
    r"|lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?)"
)
# the embedding's LoRA (PEFT: ParameterDicts, no ".weight"), and PEFT's copy of the base table
_EMBED_RE = re.compile(r"model\.embed_tokens\.lora_embedding_(?P<ab>[AB])(?:\.[^.]+)?")
_BASE_RE = re.compile(r"(?P<module>model\.embed_tokens|lm_head)\.base_layer\.weight")
# a modules_to_save table (PEFT drops its ``modules_to_save.<adapter>`` part when saving)
_FULL_RE = re.compile(r"(?P<module>model\.embed_tokens|lm_head)\.weight")
# PEFT's extra copies of a resized table (``save_embedding_layers``: the adapter's again and
# the resized base's); read only with lora_extra_vocab_size > 0, never used
_COPY_RE = re.compile(
    r"(?:base_model\.model\.)?(?P<module>model\.embed_tokens|lm_head)\."
    r"(?:modules_to_save|original_module)\.weight"
)
_MODULE_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
_PARENT = {
    m: "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn" for m in LORA_MODULES
}


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


@dataclass(frozen=True)
class ModuleReport:
    layer: int
    module: str  # short name, e.g. "q_proj"
    rank: int
    a_key: str
    b_key: str


@dataclass(frozen=True)
class PreflightReport:
    config: PeftLoRAConfig
    modules: dict[tuple[int, str], ModuleReport]  # (layer, module) -> report
    rank: int  # largest rank over all modules
    tensor_bytes: int
    file_bytes: int  # adapter_config.json + adapter_model.safetensors
    header_bytes: int
    dtypes: frozenset[str]
    full: tuple[str, ...] = ()  # modules_to_save tables ("embed_tokens", "lm_head")
    vocab_rows: int = 0  # rows of those tables (> the base's: the adapter added tokens); 0: none


def preflight(
    folder: str | Path,
    model_config: ModelConfig,
    *,
    max_lora_rank: int,
    max_bytes: int | None,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    full_modules: bool = False,
) -> PreflightReport:
    """Validate an adapter folder against the base model; raise a typed LoRAError if unfit.
    ``full_modules``: the engine serves modules_to_save tables (``max_full_module_loras``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterNotFoundError(f"adapter folder {str(folder)!r} does not exist")
    wpath, cpath = _weights_path(folder), folder / CONFIG_FILE
    if not cpath.is_file():
        raise AdapterConfigError(f"no {CONFIG_FILE} in {folder}", field=CONFIG_FILE)
    csize, wsize = cpath.stat().st_size, wpath.stat().st_size
    if max_bytes is not None and csize + wsize > max_bytes:
        raise AdapterTooLargeError(
            f"adapter files are {csize + wsize} bytes ({WEIGHTS_FILE}: {wsize}), above the "
            f"quota of {max_bytes}",
            field=WEIGHTS_FILE,
        )
    config = _read_config(cpath, csize)
    check_targets(config, model_config)
    check_full_modules_allowed(config, full_modules)
    header = read_safetensors_header(wpath, max_header_bytes=max_header_bytes)
    full: dict[str, str] = {}
    modules = _check_modules(header.tensors, config, model_config, max_lora_rank, full)
    rows = {t.key: t.shape[0] for t in header.tensors if t.key in full.values()}
    return PreflightReport(
        config=config,
        modules=modules,
        rank=max(m.rank for m in modules.values()),
        tensor_bytes=header.data_bytes,
        file_bytes=csize + wsize,
        header_bytes=header.header_bytes,
        dtypes=frozenset(t.dtype for t in header.tensors),
        full=tuple(sorted(full)),
        vocab_rows=max(rows.values(), default=0),
    )


def _weights_path(folder: Path) -> Path:
    p = folder / WEIGHTS_FILE
    if p.is_file():
        return p
    pickles = sorted(f.name for f in folder.iterdir() if f.name.endswith(_PICKLE_SUFFIXES))
    why = f"found {', '.join(pickles)}; safetensors required" if pickles else "missing"
    raise AdapterFormatError(f"{folder}: {WEIGHTS_FILE} {why}", field=WEIGHTS_FILE)


def _read_config(path: Path, size: int) -> PeftLoRAConfig:
    if size > MAX_CONFIG_BYTES:
        raise AdapterConfigError(
            f"{CONFIG_FILE} is {size} bytes, above the {MAX_CONFIG_BYTES}-byte limit",
            field=CONFIG_FILE,
        )
    return parse_peft_config_json(path.read_bytes())


def _parse_key(key: str, num_layers: int) -> tuple[int, str, str]:
    """``base_model.model.<module>.lora_A[.<adapter>].weight`` -> (layer, module, "A"/"B");
    ``<module>.lora_magnitude_vector[.<adapter>][.weight]`` (DoRA) -> "M"."""
    name = key.removeprefix("base_model.model.")
    e = _EMBED_RE.fullmatch(name)
    if e is not None:
        return VOCAB_LAYER, "embed_tokens", e.group("ab")
    b = _BASE_RE.fullmatch(name)
    if b is not None:
        return VOCAB_LAYER, vocab_module(b.group("module")) or "", "BASE"
    t = _FULL_RE.fullmatch(name)
    if t is not None:
        return VOCAB_LAYER, vocab_module(t.group("module")) or "", "FULL"
    m = _KEY_RE.fullmatch(name)
    if m is not None and m.group("module") == "lm_head" and m.group("ab"):
        return VOCAB_LAYER, "lm_head", m.group("ab")
    if m is not None:
        module = m.group("module")
    else:
        parts = name.split(".")
        i = next((j for j, p in enumerate(parts) if p.startswith("lora_")), None)
        module = ".".join(parts[:i] if i is not None else parts[:-1])
    mm = _MODULE_RE.fullmatch(module)
    if mm is None or _PARENT.get(mm.group(3)) != mm.group(2):
        raise AdapterTargetError(
            f"{WEIGHTS_FILE}: tensor {key!r} targets {module!r}, which is not a LoRA module of "
            f"the base (supported: {', '.join(LORA_MODULES + VOCAB_LORA_MODULES)})",
            field=key,
        )
    layer, short = int(mm.group(1)), mm.group(3)
    if layer >= num_layers:
        raise AdapterTargetError(
            f"{WEIGHTS_FILE}: tensor {key!r} targets layer {layer} >= num_layers {num_layers}",
            field=key,
        )
    if m is None:
        raise AdapterFormatError(
            f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight or DoRA magnitude",
            field=key,
        )
    return layer, short, m.group("ab") or "M"


def _check_modules(
    tensors: list[TensorEntry],
    config: PeftLoRAConfig,
    mc: ModelConfig,
    max_rank: int,
    tables: dict[str, str],
) -> dict[tuple[int, str], ModuleReport]:
    """The LoRA modules' reports; ``tables`` gets the modules_to_save tables' keys."""
    found: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    rows: dict[str, int] = {}
    for t in tensors:
        if is_table_copy(t.key, mc):
            check_table_copy(t.key, list(t.shape), mc)
            continue
        layer, module, ab = _parse_key(t.key, mc.num_layers)
        full = base_module_name(layer, module)
        if ab == "FULL":
            check_full_table(t.key, module, list(t.shape), t.dtype, config, mc)
            tables[module] = t.key
            rows[module] = t.shape[0]
            continue
        if ab == "BASE":  # PEFT's copy of the base table: never read, its shape must fit
            if t.shape != (mc.vocab_size, mc.hidden_size):
                raise AdapterShapeError(
                    f"{WEIGHTS_FILE}: tensor {t.key!r} has shape {t.shape}; the base's {module} "
                    f"is {(mc.vocab_size, mc.hidden_size)} (an adapter for a resized "
                    "vocabulary does not fit this base)",
                    field=t.key,
                )
            continue
        if not config.targets(full):
            raise AdapterTargetError(
                f"{WEIGHTS_FILE}: tensor {t.key!r} is for {full!r}, which {CONFIG_FILE} does not "
                "target",
                field=t.key,
            )
        pair = found.setdefault((layer, module), {})
        if ab in pair:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE}: tensors {pair[ab].key!r} and {t.key!r} are both "
                f"{_KIND[ab]} of {full!r}",
                field=t.key,
            )
        pair[ab] = t
    if not found:
        raise AdapterFormatError(f"{WEIGHTS_FILE} holds no LoRA weights", field=WEIGHTS_FILE)
    check_full_tables_present(tables, config)
    check_added_rows(rows, mc)
    shapes = mc.adapter_module_shapes()
    out: dict[tuple[int, str], ModuleReport] = {}
    for (layer, module), pair in sorted(found.items()):
        full = base_module_name(layer, module)
        check_dora_pair(pair, config, full, lambda t: t.key)
        if "A" not in pair or "B" not in pair:
            have = next(iter(pair.values())).key
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: {full!r} has {have!r} but no {missing}", field=have
            )
        a, b = pair["A"], pair["B"]
        m = pair.get("M")
        if m is not None and m.shape != (shapes[(layer, module)][1],):
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: tensor {m.key!r} has shape {m.shape}, expected "
                f"({shapes[(layer, module)][1]},) for {full!r} of the base",
                field=m.key,
            )
        for t in (a, b):
            if len(t.shape) != 2:
                raise AdapterShapeError(
                    f"{WEIGHTS_FILE}: tensor {t.key!r} has shape {t.shape}; LoRA weights are 2-D",
                    field=t.key,
                )
        r, r_cfg = a.shape[0], config.rank_for(full)
        if max(r, r_cfg) > max_rank:
            raise AdapterRankError(
                f"tensor {a.key!r} has rank {r} ({CONFIG_FILE} says {r_cfg}), above "
                f"max_lora_rank {max_rank}",
                field=a.key,
            )
        if r != r_cfg:
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: tensor {a.key!r} has rank {r}, but {CONFIG_FILE} gives "
                f"{full!r} rank {r_cfg}",
                field=a.key,
            )
        d_in, d_out = shapes[(layer, module)]
        for t, want in ((a, (r, d_in)), (b, (d_out, r))):
            if t.shape != want:
                raise AdapterShapeError(
                    f"{WEIGHTS_FILE}: tensor {t.key!r} has shape {t.shape}, expected {want} "
                    f"for {full!r} of the base",
                    field=t.key,
                )
        out[(layer, module)] = ModuleReport(layer, module, r, a.key, b.key)
    return out


_KIND = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector"}


def check_full_table(
    key: str, module: str, shape: list[int], dtype: str, config: PeftLoRAConfig, mc: ModelConfig
) -> None:
    """A modules_to_save table: listed in the config, a supported dtype, the base's
    (vocab, hidden) shape. A table with more rows (tokens the adapter added, resized
    embeddings) is refused: the served vocabulary is the base's."""
    if module not in config.modules_to_save:
        raise AdapterTargetError(
            f"{WEIGHTS_FILE}: tensor {key!r} is a full {base_module_name(VOCAB_LAYER, module)!r} "
            "table (modules_to_save), which "
            f"{CONFIG_FILE} does not list",
            field=key,
        )
    if dtype not in _ITEMSIZE:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {key!r} has dtype {dtype}; only {', '.join(_ITEMSIZE)} are "
            "supported",
            field=key,
        )
    want = [mc.vocab_size, mc.hidden_size]
    extra = mc.lora_extra_vocab_size
    if extra and len(shape) == 2 and shape[1] == mc.hidden_size:
        if mc.vocab_size <= shape[0] <= mc.vocab_size + extra:
            return  # tokens the adapter added (check_added_rows, added_tokens.py)
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {key!r} (modules_to_save) has {shape[0]} vocabulary rows; "
            f"the base has {mc.vocab_size} and lora_extra_vocab_size allows "
            f"{mc.vocab_size + extra} at most ({shape[0] - mc.vocab_size:+d} tokens)",
            field=key,
        )
    if shape != want:
        rows = shape[0] if len(shape) == 2 else None
        why = (
            f"{rows} vocabulary rows; the base has {mc.vocab_size} (an adapter that adds or "
            "drops tokens does not fit this base)"
            if rows is not None and rows != mc.vocab_size
            else f"shape {tuple(shape)}; the base's {module} is {tuple(want)}"
        )
        raise AdapterShapeError(f"{WEIGHTS_FILE}: tensor {key!r} (modules_to_save) has {why}",
                                field=key)  # fmt: skip


def is_table_copy(key: str, mc: ModelConfig) -> bool:
    """A copy PEFT saves next to a resized table (only read with lora_extra_vocab_size)."""
    return bool(mc.lora_extra_vocab_size) and _COPY_RE.fullmatch(key) is not None


def check_table_copy(key: str, shape: list[int], mc: ModelConfig) -> None:
    v, extra = mc.vocab_size, mc.lora_extra_vocab_size
    if len(shape) != 2 or shape[1] != mc.hidden_size:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {key!r} has shape {tuple(shape)}; want ({v}..{v + extra}, "
            f"{mc.hidden_size})",
            field=key,
        )
    if not v <= shape[0] <= v + extra:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {key!r} has {shape[0]} vocabulary rows; the base has {v} "
            f"and lora_extra_vocab_size allows {v + extra} at most",
            field=key,
        )


def check_added_rows(rows: dict[str, int], mc: ModelConfig) -> None:
    """An adapter that added tokens (a table past the base's rows) carries both tables, of
    one size: its new ids are embedded from its embed_tokens and scored by its lm_head."""
    v = mc.vocab_size
    if not any(n > v for n in rows.values()):
        return
    if set(rows) != {"embed_tokens", "lm_head"}:
        have = ", ".join(f"{m} ({n} rows)" for m, n in sorted(rows.items()))
        raise AdapterConfigError(
            f"{WEIGHTS_FILE}: an adapter that adds tokens needs full embed_tokens and lm_head "
            f"tables (modules_to_save); it has only {have} (the base has {v})",
            field="modules_to_save",
        )
    if len(set(rows.values())) != 1:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: embed_tokens has {rows['embed_tokens']} vocabulary rows but "
            f"lm_head {rows['lm_head']}: an adapter that adds tokens has one vocabulary",
            field="modules_to_save",
        )


def check_full_tables_present(seen: dict[str, object], config: PeftLoRAConfig) -> None:
    """Every module modules_to_save lists has its table in the file."""
    for module in config.modules_to_save:
        if module not in seen:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE}: {CONFIG_FILE} lists {module} in modules_to_save but the file "
                f"has no {base_module_name(VOCAB_LAYER, module)}.weight",
                field="modules_to_save",
            )


def check_full_modules_allowed(config: PeftLoRAConfig, full_modules: bool) -> None:
    """modules_to_save is served only with full-table slots (``max_full_module_loras`` > 0),
    and never next to a LoRA on the same module."""
    if not config.modules_to_save:
        return
    if not full_modules:
        raise AdapterConfigError(
            f"{CONFIG_FILE}: modules_to_save is not supported (got "
            f"{list(config.modules_to_save)}; the engine has no full-table slots: "
            "max_full_module_loras is 0)",
            field="modules_to_save",
        )
    both = [m for m in config.modules_to_save if config.targets(base_module_name(VOCAB_LAYER, m))]
    if both:
        raise AdapterConfigError(
            f"{CONFIG_FILE}: {', '.join(both)} is both a LoRA target and in modules_to_save",
            field="modules_to_save",
        )


def check_dora_pair(pair: dict[str, Any], config: PeftLoRAConfig, full: str, key: Any) -> None:
    """A DoRA adapter has a magnitude vector for every module it targets, a plain one none
    (``key(entry)`` names an entry of ``pair`` in the error)."""
    if config.use_dora and "M" not in pair:
        have = key(next(iter(pair.values())))
        raise AdapterFormatError(
            f"{WEIGHTS_FILE}: {full!r} has no lora_magnitude_vector, but {CONFIG_FILE} sets "
            "use_dora (a DoRA adapter needs one per targeted module)",
            field=have,
        )
    if not config.use_dora and "M" in pair:
        raise AdapterFormatError(
            f"{WEIGHTS_FILE}: tensor {key(pair['M'])!r} is a DoRA magnitude, but {CONFIG_FILE} "
            "does not set use_dora",
            field=key(pair["M"]),
        )


def read_safetensors_header(path: Path, *, max_header_bytes: int) -> SafetensorsHeader:
    """Read and check only the header; the tensors must tile the data section exactly."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8).ljust(8, b"\0"), "little") if size >= 8 else -1
        if n > max_header_bytes:
            raise _fmt(f"header length {n} is above the limit of {max_header_bytes} bytes")
        if n < 2 or 8 + n > size:
            raise _fmt(f"file of {size} bytes is too short for its header (truncated?)")
        raw = f.read(n)
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
    if dtype not in _ITEMSIZE:
        raise AdapterShapeError(
            f"{WEIGHTS_FILE}: tensor {key!r} has dtype {dtype!r}; only {', '.join(_ITEMSIZE)} "
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
    need = math.prod(shape) * _ITEMSIZE[dtype]
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
