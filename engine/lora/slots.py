"""Write an adapter's tensors into (or clear) one GPU slot of every LoRA layer of a model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.engine.lora.adapter import LoRAAdapter
    from loraplex.engine.model.llama import LlamaForCausalLM

__all__ = ["write_slot", "clear_slot"]


@torch.no_grad()
def write_slot(model: LlamaForCausalLM, slot: int, adapter: LoRAAdapter) -> None:
    """Copy every module of ``adapter`` into ``slot``; modules it does not target are zeroed.

    Copies are issued on the current stream (callers pick a side stream for cold loads).
    """
    for layer_idx, linears in model.lora_linears():
        for module, linear in linears.items():
            w = adapter.weights.get((layer_idx, module))
            if w is None:
                linear.reset_lora(slot, module)
            else:
                linear.set_lora(slot, module, w.a, w.b)


@torch.no_grad()
def clear_slot(model: LlamaForCausalLM, slot: int) -> None:
    for _, linears in model.lora_linears():
        for linear in set(linears.values()):
            linear.reset_lora(slot)
