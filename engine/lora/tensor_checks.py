"""Checks of an adapter file's tensors by name and value, used by the parser (``adapter.py``),
DoRA (``fold_dora``) and compositions (``combine.py``): which base module a PEFT key names (with
typed refusals for anything else), and the value bound every weight must meet.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from loraplex.engine.lora.adapter_files import WEIGHTS_FILE
from loraplex.engine.lora.errors import AdapterFormatError, AdapterTargetError, AdapterValueError
from loraplex.engine.lora.targets import PARENT as _PARENT
from loraplex.engine.lora.targets import vocab_module
from loraplex.engine.model.config import LORA_MODULES, VOCAB_LAYER, VOCAB_LORA_MODULES

__all__ = [
    "MAX_ADAPTER_WEIGHT",
    "check_folded_values",
    "check_weight_values",
    "fold_dora",
    "fold_scale_into",
    "parse_key",
]

_MODULE_RE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")
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
    if b.dtype == dst.dtype:  # exact copy, then one float32 product rounded once, in place
        dst.copy_(b)  # (a product written through a transposed view runs ~2 x slower)
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
