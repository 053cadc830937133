"""Which base modules a LoRA adapter may target: PEFT-style module names and the target check
shared by the adapter parser (parse.py) and the header-only preflight (preflight.py).

Per decoder layer the projections of ``LORA_MODULES``; at model level the input embedding
(``model.embed_tokens``, PEFT's ``lora_embedding_A`` / ``lora_embedding_B``) and the LM head
(``lm_head``, a plain linear LoRA), keyed ``(VOCAB_LAYER, name)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.engine.errors import AdapterConfigError, AdapterTargetError
from loraplex.engine.model.config import LORA_MODULES, VOCAB_LAYER, VOCAB_LORA_MODULES

if TYPE_CHECKING:
    from loraplex.engine.adapters.peft_config import PeftLoRAConfig
    from loraplex.engine.model.config import ModelConfig

__all__ = ["PARENT", "VOCAB_NAMES", "base_module_name", "check_targets", "vocab_module"]

PARENT = {
    m: "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn" for m in LORA_MODULES
}
# PEFT's full names of the model-level targets
VOCAB_NAMES = {"embed_tokens": "model.embed_tokens", "lm_head": "lm_head"}
_SUPPORTED = ", ".join(LORA_MODULES + VOCAB_LORA_MODULES)


def base_module_name(layer: int, module: str) -> str:
    """Full PEFT-style name of a base LoRA module, e.g. ``model.layers.0.self_attn.q_proj``
    (``model.embed_tokens`` / ``lm_head`` for ``VOCAB_LAYER``)."""
    if layer == VOCAB_LAYER:
        return VOCAB_NAMES[module]
    return f"model.layers.{layer}.{PARENT[module]}.{module}"


def vocab_module(path: str) -> str | None:
    """``embed_tokens`` / ``lm_head`` for their PEFT module paths, else None."""
    for short, full in VOCAB_NAMES.items():
        if path == full:
            return short
    return None


def check_targets(config: PeftLoRAConfig, mc: ModelConfig) -> None:
    """Raise AdapterTargetError unless every target names a LoRA module / layer of the base."""
    names = [base_module_name(i, m) for i in range(mc.num_layers) for m in LORA_MODULES]
    names += list(VOCAB_NAMES.values())
    tm = config.target_modules
    if isinstance(tm, str):
        if not any(config.targets(n) for n in names):
            raise AdapterTargetError(
                f"adapter_config.json: target_modules regex {tm!r} matches no LoRA module of "
                "the base",
                field="target_modules",
            )
    else:
        for t in tm:
            if not any(n == t or n.endswith("." + t) for n in names):
                raise AdapterTargetError(
                    f"adapter_config.json: target_modules names {t!r}, which the base has no "
                    f"LoRA module for (supported: {_SUPPORTED})",
                    field="target_modules",
                )
    if config.use_dora and any(config.targets(n) for n in VOCAB_NAMES.values()):
        raise AdapterConfigError(
            "adapter_config.json: use_dora on embed_tokens / lm_head is not supported (DoRA "
            "applies to the decoder projections here)",
            field="use_dora",
        )
    for idx in config.layers_to_transform or ():
        if idx >= mc.num_layers:
            raise AdapterTargetError(
                f"adapter_config.json: layers_to_transform has {idx} >= num_layers {mc.num_layers}",
                field="layers_to_transform",
            )
