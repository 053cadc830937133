"""Which base modules a LoRA adapter may target: PEFT-style module names and the target check
shared by the adapter parser (adapter.py) and the header-only preflight (preflight.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraplex.engine.lora.errors import AdapterTargetError
from loraplex.engine.model.config import LORA_MODULES

if TYPE_CHECKING:
    from loraplex.engine.lora.peft_config import PeftLoRAConfig
    from loraplex.engine.model.config import ModelConfig

__all__ = ["PARENT", "base_module_name", "check_targets"]

PARENT = {
    m: "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn" for m in LORA_MODULES
}
# Base modules that are linear but never LoRA targets here.
_OTHER_MODULES = ("lm_head", "model.embed_tokens")


def base_module_name(layer: int, module: str) -> str:
    """Full PEFT-style name of a base LoRA module, e.g. ``model.layers.0.self_attn.q_proj``."""
    return f"model.layers.{layer}.{PARENT[module]}.{module}"


def check_targets(config: PeftLoRAConfig, mc: ModelConfig) -> None:
    """Raise AdapterTargetError unless every target names a LoRA module / layer of the base."""
    names = [base_module_name(i, m) for i in range(mc.num_layers) for m in LORA_MODULES]
    tm = config.target_modules
    if isinstance(tm, str):
        bad = [n for n in _OTHER_MODULES if config.targets(n)]
        if bad or not any(config.targets(n) for n in names):
            raise AdapterTargetError(
                f"adapter_config.json: target_modules regex {tm!r} "
                + (f"matches {bad[0]!r}" if bad else "matches no LoRA module of the base"),
                field="target_modules",
            )
    else:
        for t in tm:
            if not any(n == t or n.endswith("." + t) for n in names):
                raise AdapterTargetError(
                    f"adapter_config.json: target_modules names {t!r}, which the base has no "
                    f"LoRA module for (supported: {', '.join(LORA_MODULES)})",
                    field="target_modules",
                )
    for idx in config.layers_to_transform or ():
        if idx >= mc.num_layers:
            raise AdapterTargetError(
                f"adapter_config.json: layers_to_transform has {idx} >= num_layers {mc.num_layers}",
                field="layers_to_transform",
            )
