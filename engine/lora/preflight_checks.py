"""Checks of an adapter's full tables (modules_to_save, added tokens) and DoRA magnitudes,
shared by the preflight (``preflight.py``: the header only) and the parser (``adapter.py``:
the tensors). Each raises a typed error naming the tensor or the config field.
"""

from __future__ import annotations

import re
from typing import Any

from loraplex.engine.lora.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.engine.lora.adapter_files import ITEMSIZE as _ITEMSIZE
from loraplex.engine.lora.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterShapeError,
    AdapterTargetError,
)
from loraplex.engine.lora.peft_config import PeftLoRAConfig
from loraplex.engine.lora.targets import base_module_name
from loraplex.engine.model.config import VOCAB_LAYER, ModelConfig

__all__ = [
    "check_added_rows",
    "check_dora_pair",
    "check_full_modules_allowed",
    "check_full_table",
    "check_full_tables_present",
    "check_table_copy",
    "is_table_copy",
]

# PEFT's extra copies of a resized table (``save_embedding_layers``: the adapter's again and
# the resized base's); read only with lora_extra_vocab_size > 0, never used
_COPY_RE = re.compile(
    r"(?:base_model\.model\.)?(?P<module>model\.embed_tokens|lm_head)\."
    r"(?:modules_to_save|original_module)\.weight"
)


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
