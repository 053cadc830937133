"""Check an adapter folder before any tensor data is read.

Reads ``adapter_config.json`` and only the header of ``adapter_model.safetensors`` (8-byte
little-endian length, then JSON). It checks the header's structure (length limit, dtypes,
shapes, offsets that tile the data section exactly) and the adapter against the base model
(targets, ranks, A ``(r, in)`` / B ``(out, r)`` shapes) and the byte quota. Blocking: run it
in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loraplex.engine.adapters.checks import (
    check_added_rows,
    check_dora_pair,
    check_expert_forms,
    check_full_modules_allowed,
    check_full_table,
    check_full_tables_present,
    check_module_exists,
    check_table_copy,
    is_table_copy,
    is_targeted,
    module_dims,
    parse_key,
    resolve_expert_module,
)
from loraplex.engine.adapters.files import (
    CONFIG_FILE,
    DEFAULT_MAX_HEADER_BYTES,
    WEIGHTS_FILE,
    SafetensorsHeader,
    TensorEntry,
    read_safetensors_header,
)
from loraplex.engine.adapters.peft_config import PeftLoRAConfig, parse_peft_config_json
from loraplex.engine.adapters.targets import base_module_name, check_targets
from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterTooLargeError,
)
from loraplex.engine.model.config import (
    ModelConfig,
)

__all__ = [
    "DEFAULT_MAX_HEADER_BYTES",
    "ModuleReport",
    "PreflightReport",
    "SafetensorsHeader",
    "TensorEntry",
    "preflight",
    "check_config",
    "check_header",
    "read_safetensors_header",
    "check_dora_pair",
    "check_full_modules_allowed",
    "check_added_rows",
    "check_full_table",
    "check_table_copy",
    "is_table_copy",
    "check_full_tables_present",
]

MAX_CONFIG_BYTES = 1 << 20
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ModuleReport:
    layer: int
    module: str  # short name, e.g. "q_proj"
    rank: int
    a_key: str
    b_key: str
    in_out: tuple[int, int] = (0, 0)  # the base module's (in_features, out_features)
    m_key: str | None = None  # DoRA's magnitude vector
    # a fused experts module (model/moe/lora_names.py): E rank-r pairs in one A (r*E, in) and
    # B (out, r*E); ``rank`` is r. 1 for every other module
    experts: int = 1


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
    tables: dict[str, str] = field(default_factory=dict)  # those tables' keys by module


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
    return check_header(header, config, model_config, max_lora_rank, csize + wsize)


def check_config(raw: bytes, model_config: ModelConfig, *, full_modules: bool) -> PeftLoRAConfig:
    """``adapter_config.json``'s bytes parsed and checked against the base (the preflight's
    config checks, for a pass that holds the bytes already)."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterConfigError(
            f"{CONFIG_FILE} is {len(raw)} bytes, above the {MAX_CONFIG_BYTES}-byte limit",
            field=CONFIG_FILE,
        )
    config = parse_peft_config_json(raw)
    check_targets(config, model_config)
    check_full_modules_allowed(config, full_modules)
    return config


def check_header(
    header: SafetensorsHeader,
    config: PeftLoRAConfig,
    model_config: ModelConfig,
    max_lora_rank: int,
    file_bytes: int,
) -> PreflightReport:
    """The preflight's checks of a header (already structure-checked) against the config and
    the base; ``file_bytes``: both files' size."""
    full: dict[str, str] = {}
    modules = _check_modules(header.tensors, config, model_config, max_lora_rank, full)
    rows = {t.key: t.shape[0] for t in header.tensors if t.key in full.values()}
    return PreflightReport(
        config=config,
        modules=modules,
        rank=max(m.rank for m in modules.values()),
        tensor_bytes=header.data_bytes,
        file_bytes=file_bytes,
        header_bytes=header.header_bytes,
        dtypes=frozenset(t.dtype for t in header.tensors),
        full=tuple(sorted(full)),
        vocab_rows=max(rows.values(), default=0),
        tables=dict(full),
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
        layer, module, ab = parse_key(t.key, mc.num_layers)
        module = resolve_expert_module(layer, module, t.key, config, mc)
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
        if not is_targeted(config, full, module):
            raise AdapterTargetError(
                f"{WEIGHTS_FILE}: tensor {t.key!r} is for {full!r}, which {CONFIG_FILE} does not "
                "target",
                field=t.key,
            )
        check_module_exists(layer, module, t.key, mc)
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
    check_expert_forms(
        {k: p["A" if "A" in p else next(iter(p))].key for k, p in found.items()}, config
    )
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
        d_in, d_out, experts = module_dims(layer, module, mc)
        if m is not None and m.shape != (d_out,):
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: tensor {m.key!r} has shape {m.shape}, expected "
                f"({d_out},) for {full!r} of the base",
                field=m.key,
            )
        for t in (a, b):
            if len(t.shape) != 2:
                raise AdapterShapeError(
                    f"{WEIGHTS_FILE}: tensor {t.key!r} has shape {t.shape}; LoRA weights are 2-D",
                    field=t.key,
                )
        r, r_cfg = a.shape[0] // experts, config.rank_for(full)
        if experts > 1 and a.shape[0] != r_cfg * experts:
            raise AdapterShapeError(
                f"{WEIGHTS_FILE}: tensor {a.key!r} has {a.shape[0]} rows; {full!r} wants rank "
                f"{r_cfg} ({CONFIG_FILE}) x {experts} experts = {r_cfg * experts} rows (an "
                "adapter for another expert count does not fit this base)",
                field=a.key,
            )
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
        for t, want in ((a, (r * experts, d_in)), (b, (d_out, r * experts))):
            if t.shape != want:
                raise AdapterShapeError(
                    f"{WEIGHTS_FILE}: tensor {t.key!r} has shape {t.shape}, expected {want} "
                    f"for {full!r} of the base",
                    field=t.key,
                )
        mkey = m.key if m is not None else None
        out[(layer, module)] = ModuleReport(
            layer, module, r, a.key, b.key, (d_in, d_out), mkey, experts
        )
    return out


_KIND = {"A": "lora_A", "B": "lora_B", "M": "lora_magnitude_vector"}
