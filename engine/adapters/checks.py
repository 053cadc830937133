"""The checks an adapter's names, shapes and values pass, shared by the preflight
(``preflight.py``: the header only), the parser (``parse.py``: the tensors), DoRA
(``fold_dora``) and compositions (``combine.py``): which base module a PEFT key names (typed
refusals for anything else), the value bound every weight meets, the full tables
(modules_to_save, added tokens) and DoRA magnitudes. Each raises a typed error naming the
tensor or the config field.

One concept, ~450 lines (with the expert-adapter rules of MoE models): what an adapter file may
contain, read by the preflight and the parser alike so the two never disagree.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from loraplex.engine.adapters.files import CONFIG_FILE, WEIGHTS_FILE
from loraplex.engine.adapters.files import ITEMSIZE as _ITEMSIZE
from loraplex.engine.adapters.peft_config import PeftLoRAConfig
from loraplex.engine.adapters.targets import PARENT as _PARENT
from loraplex.engine.adapters.targets import base_module_name, vocab_module
from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterValueError,
)
from loraplex.engine.model.config import LORA_MODULES, VOCAB_LAYER, VOCAB_LORA_MODULES, ModelConfig
from loraplex.engine.model.moe.lora_names import FUSED_PARAMS, PROJ_ROLE, expert_module

__all__ = [
    "check_added_rows",
    "check_dora_pair",
    "check_full_modules_allowed",
    "check_full_table",
    "check_full_tables_present",
    "check_table_copy",
    "is_table_copy",
    "MAX_ADAPTER_WEIGHT",
    "check_folded_values",
    "check_weight_values",
    "fold_dora",
    "fold_scale_into",
    "parse_key",
    "resolve_expert_module",
    "is_targeted",
    "module_dims",
    "check_expert_forms",
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


_MODULE_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")
# an expert module: PEFT's wrapped fused experts (``experts``, ``experts.base_layer`` ... one
# ``base_layer`` per parameter wrapped after it) or one expert's projection
_EXPERT_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(experts(?:\.base_layer)*|experts\.\d+\.\w+)"
)
# Largest |w| accepted in lora_A and in lora_B with the LoRA scale folded in. Trained adapters
# sit orders of magnitude below: PEFT starts A at U(+-1/sqrt(in)) and B at 0, trained entries
# stay O(0.01-1) and scales (alpha/r, alpha/sqrt(r)) are O(1-100). It is also below float16's
# largest value (65504), so the cast to a half serving dtype cannot overflow to Inf. Values
# past it only come from broken or hostile files (NaN / Inf / 3e38 made empty outputs).
MAX_ADAPTER_WEIGHT = 1e4


def _resolve_module(name: str, num_layers: int) -> tuple[int, str]:
    short = vocab_module(name)
    if short is not None:
        return VOCAB_LAYER, short
    m = _MODULE_RE.fullmatch(name)
    x = _EXPERT_RE.fullmatch(name)
    sub = x.group(2) if x is not None else ""
    if sub == "experts" or sub.startswith("experts.base_layer") or sub.rsplit(".")[-1] in PROJ_ROLE:
        assert x is not None
        layer = int(x.group(1))
        if layer >= num_layers:
            raise AdapterTargetError(
                f"adapter weights target {name!r}: layer {layer} >= num_layers {num_layers}",
                field=name,
            )
        return layer, sub
    if m is None or m.group(3) not in LORA_MODULES or _PARENT[m.group(3)] != m.group(2):
        raise AdapterTargetError(
            f"adapter weights target module {name!r}, which is not a LoRA module of the base "
            f"(supported: {', '.join(LORA_MODULES + VOCAB_LORA_MODULES)})",
            field=name,
        )
    layer = int(m.group(1))
    if layer >= num_layers:
        raise AdapterTargetError(
            f"adapter weights target {name!r}: layer {layer} >= num_layers {num_layers}", field=name
        )
    return layer, m.group(3)


def parse_key(key: str, num_layers: int) -> tuple[int, str, str]:
    """``base_model.model.<module>.lora_A[.<adapter>].weight`` -> (layer, module, "A" or "B");
    ``<module>.lora_magnitude_vector[.<adapter>][.weight]`` (DoRA) -> "M";
    ``model.embed_tokens.lora_embedding_A[.<adapter>]`` -> "A" (``_B``: "B");
    ``model.embed_tokens`` / ``lm_head`` ``.base_layer.weight`` -> "BASE" (PEFT saves the base
    table next to a LoRA on it; never read: the served base is the model's);
    ``model.embed_tokens.weight`` / ``lm_head.weight`` -> "FULL" (a modules_to_save table)."""
    parts = key.removeprefix("base_model.model.").split(".")
    i = next((j for j, p in enumerate(parts) if p.startswith("lora_")), None)
    if i is None and parts[-2:] == ["base_layer", "weight"]:
        layer, short = _resolve_module(".".join(parts[:-2]), num_layers)
        if layer == VOCAB_LAYER:
            return layer, short, "BASE"
    if i is None:  # a full weight, e.g. modules_to_save's lm_head.weight
        module = ".".join(parts[:-1] if parts[-1] in ("weight", "bias") else parts)
    else:
        module = ".".join(parts[:i])
    layer, short = _resolve_module(module, num_layers)
    if i is None and layer == VOCAB_LAYER and parts[-1] == "weight":
        return layer, short, "FULL"  # modules_to_save's table (checked against the config)
    if i is None and layer == VOCAB_LAYER:
        raise AdapterFormatError(
            f"{WEIGHTS_FILE}: tensor {key!r} is not a full {short} table or a LoRA weight",
            field=key,
        )
    rest = parts[i + 1 :] if i is not None else []
    if i is not None and short == "embed_tokens":
        if parts[i] in ("lora_embedding_A", "lora_embedding_B") and len(rest) < 2:
            return layer, short, parts[i][-1]
        raise AdapterFormatError(
            f"{WEIGHTS_FILE}: tensor {key!r} is not a lora_embedding_A / lora_embedding_B",
            field=key,
        )
    magnitude = i is not None and parts[i] == "lora_magnitude_vector"
    if magnitude and (len(rest) < 2 or (len(rest) == 2 and rest[-1] == "weight")):
        return layer, short, "M"
    if (
        i is None
        or parts[i] not in ("lora_A", "lora_B")
        or rest[-1:] != ["weight"]
        or len(rest) > 2
    ):
        raise AdapterFormatError(
            f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight or DoRA magnitude",
            field=key,
        )
    return layer, short, parts[i][-1]


def resolve_expert_module(
    layer: int, module: str, key: str, config: PeftLoRAConfig, mc: ModelConfig
) -> str:
    """``module`` as ``parse_key`` found it -> the module it names: PEFT's wrapped fused
    experts (``experts`` + one ``.base_layer`` per parameter wrapped after this one) become
    ``experts.gate_up_proj`` / ``experts.down_proj``. PEFT wraps the targeted parameters in
    the model's parameter order (``FUSED_PARAMS``), the first innermost: which key is which
    parameter follows that order, not the config's list. Other names come back unchanged."""
    if module != "experts" and not module.startswith("experts.base_layer"):
        return module
    depth = module.count(".base_layer")
    wrapped = [
        p for p in FUSED_PARAMS if config.targets_parameter(f"model.layers.{layer}.mlp.experts.{p}")
    ]
    if depth >= len(wrapped):
        raise AdapterTargetError(
            f"{WEIGHTS_FILE}: tensor {key!r} is for a wrapped experts parameter that "
            f"{CONFIG_FILE}'s target_parameters do not name (it names "
            f"{list(config.target_parameters) or 'none'} for layer {layer})",
            field=key,
        )
    return f"experts.{wrapped[len(wrapped) - 1 - depth]}"


def module_dims(layer: int, module: str, mc: ModelConfig) -> tuple[int, int, int]:
    """(in, out, experts) of a LoRA module the base has (``check_module_exists`` passed):
    ``experts`` > 1 for a fused experts module (its A holds that many rank-r blocks)."""
    dims = mc.expert_module_shape(module)
    if dims is not None:
        return dims
    shapes = mc.vocab_lora_shapes() if layer == VOCAB_LAYER else mc.lora_module_shapes()
    return (*shapes[module], 1)


def check_expert_forms(keys: dict[tuple[int, str], str], config: PeftLoRAConfig) -> None:
    """``keys``: a tensor key per (layer, module) of an adapter. A layer's experts come in one
    layout (fused or per expert), plain LoRA (no DoRA: PEFT has none for experts either)."""
    forms: dict[int, set[bool]] = {}
    for (layer, module), key in sorted(keys.items()):
        em = expert_module(module)
        if em is None:
            continue
        if config.use_dora:
            raise AdapterConfigError(
                f"{CONFIG_FILE}: use_dora on the experts ({key!r}) is not supported",
                field="use_dora",
            )
        seen = forms.setdefault(layer, set())
        seen.add(em.fused)
        if len(seen) > 1:
            raise AdapterFormatError(
                f"{WEIGHTS_FILE}: layer {layer}'s experts have both fused (target_parameters) "
                f"and per-expert tensors ({key!r}): one layout per layer",
                field=key,
            )


def is_targeted(config: PeftLoRAConfig, full: str, module: str) -> bool:
    """Whether the config targets the module of full name ``full``: a fused experts module by
    target_parameters, everything else by target_modules."""
    em = expert_module(module)
    if em is not None and em.fused:
        return config.targets_parameter(full)
    return config.targets(full)


def check_module_exists(layer: int, module: str, key: str, mc: ModelConfig) -> None:
    """A LoRA tensor must be for a projection the base has: a mixture-of-experts model's
    sparse layers have experts instead of a dense MLP, so ``mlp.gate_proj`` there names
    nothing (expert LoRA is refused by its own checks)."""
    em = expert_module(module)
    if em is not None and not mc.has_module(layer, module):
        moe = mc.moe
        if moe is None:
            why = f"the base ({mc.architecture}) has no experts"
        elif not moe.is_sparse(layer):
            why = f"layer {layer} is a dense layer (no experts)"
        else:
            why = f"the base has {moe.num_experts} experts (0 .. {moe.num_experts - 1})"
        raise AdapterTargetError(
            f"{WEIGHTS_FILE}: tensor {key!r} is for {base_module_name(layer, module)!r}: {why}",
            field=key,
        )
    if layer != VOCAB_LAYER and not mc.has_module(layer, module):
        raise AdapterTargetError(
            f"{WEIGHTS_FILE}: tensor {key!r} is for {base_module_name(layer, module)!r}, which "
            f"the base does not have (layer {layer} is a mixture-of-experts layer: its MLP is "
            "experts, not a dense gate_proj / up_proj / down_proj)",
            field=key,
        )


def check_weight_values(t: torch.Tensor, key: str, *, scale: float | None = None) -> None:
    """Raise AdapterValueError if ``t`` holds NaN, +-Inf or an entry above
    ``MAX_ADAPTER_WEIGHT`` in magnitude. One reduction pass (NaN propagates through amax);
    the finiteness pass runs only to word the error. ``scale``: already folded into ``t``."""
    if t.numel() == 0:
        return
    peak = float(_peak(t))
    if peak <= MAX_ADAPTER_WEIGHT:
        return
    folded = "" if scale is None else f" (LoRA scale {scale:g} folded in)"
    if not bool(torch.isfinite(t).all()):
        n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        why = f"holds {n_nan} NaN and {n_inf} infinite values{folded}"
    else:
        why = f"has an entry of magnitude {peak:.3g}{folded}, above {MAX_ADAPTER_WEIGHT:g}"
    raise AdapterValueError(f"{WEIGHTS_FILE}: tensor {key!r} {why}", field=key)


def _peak(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a float32 0-dim tensor, NaN if ``t`` holds one: one min/max pass in the
    tensor's own dtype, no |t| copy."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(lo.float().abs(), hi.float().abs())


def check_folded_values(t: torch.Tensor, key: str, scale: float) -> None:
    """``check_weight_values`` of ``t.float() * scale`` without making it: rounding is
    monotonic, so the largest folded magnitude is round32(max |t| * |scale|). Only a failing
    tensor is folded (to word the error)."""
    if t.numel() == 0:
        return
    if float(_peak(t) * abs(scale)) <= MAX_ADAPTER_WEIGHT:
        return
    check_weight_values(t.float() * scale, key, scale=scale)


def fold_scale_into(dst: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """``dst.copy_((b.float() * scale).to(dst.dtype))`` in one pass, bit for bit: the product is
    rounded to float32 and then to ``dst``'s dtype either way (``dst`` may be a strided view,
    e.g. the transposed B block of a packed slot image)."""
    if dst.dim() == 2 and not dst.is_contiguous() and dst.t().is_contiguous():
        # the same elements through the block's own (contiguous) layout: a write through the
        # transposed view runs ~3-10 x slower than a strided read into contiguous rows
        dst, b = dst.t(), b.t()
    if b.dtype == dst.dtype or dst.dtype == torch.float32:
        # exact copy (a widening cast is exact too), then one float32 product rounded once,
        # in place: the bits of ``(b.float() * scale).to(dst.dtype)``
        dst.copy_(b)
        if scale != 1.0:
            dst.mul_(scale)
    else:
        torch.mul(b.float(), scale, out=dst)


@torch.no_grad()
def fold_dora(adapter: Any, scales: dict[tuple[int, str], torch.Tensor]) -> None:
    """A DoRA adapter's row scales g (model/lora/dora.py ``row_scales``) checked and folded
    into its B in place (the packed image's B blocks are the same storage); sets
    ``adapter.dora``. Trained magnitudes keep g near 1: NaN, Inf or huge g come from broken
    files and are refused (AdapterValueError)."""
    for key, g in scales.items():
        check_weight_values(g, f"layer {key[0]} {key[1]} DoRA scale m / ||W + s B A||")
        b = adapter.weights[key].b  # (out, r): a view of the packed image, or the tensor
        scaled = b.float() * g[:, None]
        check_weight_values(scaled, f"layer {key[0]} {key[1]} lora_B (DoRA scale folded in)")
        b.copy_(scaled)
    adapter.dora = scales
