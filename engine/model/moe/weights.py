"""HF checkpoint keys -> ``MoeForCausalLM`` tensors (``registry.WeightMap``), and ``FAMILY``.

The Hub stores experts one projection per tensor, and transformers 5 still saves them so (it
fuses them only in memory); both forms load, under either parent name (``mlp`` as Qwen3-MoE and
transformers 5 name it, ``block_sparse_moe`` as Mixtral's checkpoints do)::

    per expert   model.layers.{i}.mlp.experts.{e}.gate_proj.weight   (I, H)  -> w_gate_up[e, :I]
                 ... .up_proj.weight (I, H) -> w_gate_up[e, I:];  .down_proj.weight (H, I) -> w_down[e]
                 Mixtral: block_sparse_moe.experts.{e}.w1 (gate), .w3 (up), .w2 (down)
    fused        model.layers.{i}.mlp.experts.gate_up_proj (E, 2I, H), .down_proj (E, H, I)
    router       model.layers.{i}.mlp.gate.weight / block_sparse_moe.gate.weight   (E, H)
    q / k norm   model.layers.{i}.self_attn.q_norm.weight, .k_norm.weight          (D,)

Everything else (embedding, norms, attention, a dense layer's MLP, LM head) is Llama's map.
"""

from __future__ import annotations

import re

import torch

from loraplex.engine.model.llama import LlamaWeights
from loraplex.engine.model.loader import ModelLoadError
from loraplex.engine.model.moe.model import MoeForCausalLM
from loraplex.engine.model.registry import ModelFamily

__all__ = ["MoeWeights", "FAMILY"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?:mlp|block_sparse_moe)\.gate\.weight$")
_DENSE_MLP = ("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")
# an expert's projection name -> (its weight, half of gate_up: 0 gate, 1 up, None: all)
_PROJ = {
    "gate_proj": ("w_gate_up", 0),
    "w1": ("w_gate_up", 0),
    "up_proj": ("w_gate_up", 1),
    "w3": ("w_gate_up", 1),
    "down_proj": ("w_down", None),
    "w2": ("w_down", None),
}


class MoeWeights:
    """The MoE families' checkpoint map (module docstring)."""

    def __init__(self) -> None:
        self.dense = LlamaWeights()

    def target(self, model: MoeForCausalLM, name: str) -> torch.Tensor | None:
        m = _LAYER.match(name)
        if m is None:
            return self.dense.target(model, name)
        idx, rest = int(m.group(1)), m.group(2)
        if idx >= len(model.layers):
            raise ModelLoadError(f"checkpoint has layer {idx}, config has {len(model.layers)}")
        layer = model.layers[idx]
        if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            norm = layer.q_norm if rest.startswith("self_attn.q") else layer.k_norm
            if norm is None:
                raise ModelLoadError(f"{name}: the config's model_type has no q / k norm")
            return norm.weight
        expert, fused = _EXPERT.match(rest), _FUSED.match(rest)
        block = layer.mlp
        if expert is None and fused is None and _ROUTER.match(rest) is None:
            if block is not None and rest.startswith(_DENSE_MLP):
                raise ModelLoadError(f"{name}: layer {idx} is a sparse (experts) layer")
            return self.dense.target(model, name)
        if block is None:
            raise ModelLoadError(f"{name}: layer {idx} is a dense layer in the config")
        if fused is not None:
            return getattr(block, "w_gate_up" if fused.group(1) == "gate_up_proj" else "w_down")
        if expert is None:
            return block.router
        e, proj = int(expert.group(1)), expert.group(2)
        if e >= block.spec.num_experts:
            raise ModelLoadError(
                f"{name}: checkpoint has expert {e}, config has {block.spec.num_experts}"
            )
        if proj not in _PROJ:
            return None
        attr, half = _PROJ[proj]
        w = getattr(block, attr)[e]
        if half is None:
            return w
        i = block.spec.expert_size
        return w[half * i : (half + 1) * i]

    def units(self, model: MoeForCausalLM) -> list[tuple[str, torch.Tensor]]:
        """Every weight the checkpoint must fill."""
        units = [("model.embed_tokens", model.embed_tokens), ("model.norm", model.norm.weight)]
        if not model.cfg.tie_word_embeddings:
            units.append(("lm_head", model.lm_head))
        for i, layer in enumerate(model.layers):
            for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                lin = getattr(layer, attr)
                if lin is None:
                    continue
                units.append((f"layers.{i}.{attr}.weight", lin.weight))
                if lin.bias is not None:
                    units.append((f"layers.{i}.{attr}.bias", lin.bias))
            for attr in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
                norm = getattr(layer, attr)
                if norm is not None:
                    units.append((f"layers.{i}.{attr}", norm.weight))
            if layer.mlp is not None:
                for attr in ("router", "w_gate_up", "w_down"):
                    units.append((f"layers.{i}.mlp.{attr}", getattr(layer.mlp, attr)))
        return units


FAMILY = ModelFamily(MoeForCausalLM, MoeWeights())
