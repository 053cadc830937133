"""Which base modules a LoRA adapter may target: PEFT-style module names and the target check
shared by the adapter parser (parse.py) and the header-only preflight (preflight.py).

Per decoder layer the projections of ``LORA_MODULES``; at model level the input embedding
(``model.embed_tokens``, PEFT's ``lora_embedding_A`` / ``lora_embedding_B``) and the LM head
(``lm_head``, a plain linear LoRA), keyed ``(VOCAB_LAYER, name)``. On a mixture-of-experts
base, the sparse layers' experts (model/moe/lora_names.py): PEFT's ``target_parameters`` on the
fused experts, or per-expert ``target_modules``. The router is never adapted: a config that
targets it is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.engine.errors import AdapterConfigError, AdapterTargetError
from loraplex.engine.model.config import LORA_MODULES, VOCAB_LAYER, VOCAB_LORA_MODULES
from loraplex.engine.model.moe.lora_names import (
    FUSED_PARAMS,
    expert_module,
    expert_parent,
    per_expert_name,
)

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
    if module not in PARENT and expert_module(module) is not None:
        return f"model.layers.{layer}.{expert_parent(module)}.{module}"
    return f"model.layers.{layer}.{PARENT[module]}.{module}"


def expert_names(mc: ModelConfig) -> list[str]:
    """Full names of the per-expert LoRA modules of a mixture-of-experts base (none for a
    dense one)."""
    moe = mc.moe
    if moe is None:
        return []
    mixtral = mc.model_type == "mixtral"
    return [
        base_module_name(i, per_expert_name(e, role, mixtral))
        for i in moe.sparse_layers
        for e in range(moe.num_experts)
        for role in ("gate", "up", "down")
    ]


def _is_router(target: str) -> bool:
    return target == "gate" or target.endswith((".gate", ".gate.weight"))


def check_parameters(config: PeftLoRAConfig, mc: ModelConfig) -> None:
    """PEFT's target_parameters name the fused experts' gate_up_proj / down_proj of a
    mixture-of-experts base, nothing else (the router is not adapted)."""
    if not config.target_parameters:
        return
    if mc.moe is None or not mc.moe.sparse_layers:
        raise AdapterTargetError(
            f"adapter_config.json: target_parameters {list(config.target_parameters)} are for a "
            f"mixture-of-experts model's experts; the base ({mc.architecture}) has none",
            field="target_parameters",
        )
    if config.use_dora:
        raise AdapterConfigError(
            "adapter_config.json: use_dora on target_parameters (experts) is not supported",
            field="use_dora",
        )
    names = [
        f"model.layers.{i}.mlp.experts.{p}" for i in mc.moe.sparse_layers for p in FUSED_PARAMS
    ]
    for t in config.target_parameters:
        if _is_router(t):
            raise AdapterTargetError(
                f"adapter_config.json: target_parameters names the router {t!r}; LoRA on the "
                "router is not served (adapt the experts: mlp.experts.gate_up_proj, "
                "mlp.experts.down_proj)",
                field="target_parameters",
            )
        if not any(n == t or n.endswith("." + t) for n in names):
            raise AdapterTargetError(
                f"adapter_config.json: target_parameters names {t!r}, which is not a parameter "
                "LoRA is served on (supported: mlp.experts.gate_up_proj, mlp.experts.down_proj)",
                field="target_parameters",
            )


def vocab_module(path: str) -> str | None:
    """``embed_tokens`` / ``lm_head`` for their PEFT module paths, else None."""
    for short, full in VOCAB_NAMES.items():
        if path == full:
            return short
    return None


def check_targets(config: PeftLoRAConfig, mc: ModelConfig) -> None:
    """Raise AdapterTargetError unless every target names a LoRA module / layer of the base."""
    check_parameters(config, mc)
    names = [base_module_name(i, m) for i in range(mc.num_layers) for m in LORA_MODULES]
    names += list(VOCAB_NAMES.values())
    names += expert_names(mc)
    tm = config.target_modules
    if isinstance(tm, str):
        if not any(config.targets(n) for n in names) and not config.target_parameters:
            raise AdapterTargetError(
                f"adapter_config.json: target_modules regex {tm!r} matches no LoRA module of "
                "the base",
                field="target_modules",
            )
    else:
        for t in tm:
            if mc.moe is not None and _is_router(t):
                raise AdapterTargetError(
                    f"adapter_config.json: target_modules names the router {t!r}; LoRA on the "
                    "router is not served (adapt attention and the experts)",
                    field="target_modules",
                )
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
