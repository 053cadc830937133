"""Tiny random mixture-of-experts HF models (Qwen3-MoE, Mixtral), made on the fly for tests.

``make_tiny_moe`` saves a transformers checkpoint as transformers 5 does (experts one tensor per
projection on disk); ``fuse_experts`` rewrites one in the fused in-memory form
(``mlp.experts.gate_up_proj`` / ``down_proj``) that the loader also reads. PEFT adapters on
them: ``models.make_peft_adapter``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.models import TINY_CONFIG, _randomise

__all__ = ["MOE_KINDS", "make_tiny_moe", "fuse_experts"]

# per kind: the transformers config class name and the fields beyond TINY_CONFIG
MOE_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    # a dense layer among sparse ones (mlp_only_layers), top-k probabilities not renormalised
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=6),
    ),
}


def make_tiny_moe(dir: str | Path, kind: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random ``kind`` (``MOE_KINDS``) causal LM to ``dir``; return it."""
    import transformers

    cls_name, fields = MOE_KINDS[kind]
    config = getattr(transformers, cls_name)(**{**TINY_CONFIG, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    out = Path(dir)
    model.save_pretrained(out)
    return out


_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


def fuse_experts(model_dir: str | Path) -> None:
    """Rewrite ``model.safetensors`` in place with each layer's experts as the fused
    ``mlp.experts.gate_up_proj`` (E, 2I, H) and ``mlp.experts.down_proj`` (E, H, I)."""
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    layers: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, t in tensors.items():
        m = _EXPERT.match(key)
        if m is None:
            out[key] = t
            continue
        layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, experts in layers.items():
        order = [experts[e] for e in sorted(experts)]
        pick = lambda ex, names: next(ex[n] for n in names if n in ex)  # noqa: E731
        gate_up = [torch.cat([pick(ex, _GATE), pick(ex, _UP)]) for ex in order]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([pick(ex, _DOWN) for ex in order])
    save_file(out, path, metadata={"format": "pt"})
