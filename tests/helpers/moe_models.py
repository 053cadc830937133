"""Tiny random mixture-of-experts HF models (Qwen3-MoE, Mixtral), made on the fly for tests.

``make_tiny_moe`` saves a transformers checkpoint as transformers 5 does (experts one tensor per
projection on disk); ``fuse_experts`` rewrites one in the fused in-memory form
(``mlp.experts.gate_up_proj`` / ``down_proj``) that the loader also reads. PEFT adapters on
them: ``models.make_peft_adapter``; on their experts: ``make_expert_adapter`` (PEFT's
``target_parameters``) and ``to_per_expert`` (the same weights in the per-expert
``target_modules`` form of transformers 4's adapters, which this PEFT cannot make: written by
hand from the documented layout).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.models import TINY_CONFIG, _randomise

__all__ = ["MOE_KINDS", "EXPERT_PARAMS", "make_tiny_moe", "fuse_experts", "make_expert_adapter",
           "router_margins", "to_per_expert"]  # fmt: skip

EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

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


def router_margins(model_dir, adapters, prompts, names, tokens) -> list[list[float]]:
    """Per step of ``hf_mixed_batch`` (its decode forced to ``tokens``) and row: how clear the
    routing of the token whose logits that step gives is, in float32 PEFT: the smallest gap,
    over the MoE layers, between the k-th and the (k+1)-th router probability (k: top-k).

    A random tiny router is near-uniform, so some tokens' top-k choice hangs on a gap below
    what half precision perturbs: a bfloat16 run (PEFT's or ours) may route such a token to
    another expert than the float32 reference, and its logits jump (a discontinuity of MoE
    routing, not an error of the arithmetic)."""
    from tests.helpers.peft_oracle import hf_mixed_batch

    caps: list[tuple[int, torch.Tensor]] = []

    def hook(mod: torch.nn.Module, _args: Any, out: Any) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        caps.append((mod.top_k, logits.detach().float().cpu()))

    def prepare(model: torch.nn.Module) -> None:
        for mod in model.modules():
            if type(mod).__name__.endswith("TopKRouter"):
                mod.register_forward_hook(hook)

    hf_mixed_batch(model_dir, adapters, prompts, names, force=tokens, prepare=prepare)
    calls = len(tokens)
    layers = len(caps) // calls
    assert layers and layers * calls == len(caps), (len(caps), calls)
    width = max(len(p) for p in prompts)
    out = []
    for step in range(calls):
        row_gaps = []
        for row in range(len(prompts)):
            at = row * width + width - 1 if step == 0 else row  # (the prefill: left-padded)
            gaps = []
            for k, logits in caps[step * layers : (step + 1) * layers]:
                top = torch.sort(torch.softmax(logits[at], -1), descending=True).values
                gaps.append((top[k - 1] - top[k]).item())
            row_gaps.append(min(gaps))
        out.append(row_gaps)
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


def make_expert_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 4,
    alpha: float = 8,
    target_modules: Sequence[str] = (),
    target_parameters: Sequence[str] = EXPERT_PARAMS,
    seed: int = 0,
    **kw: Any,
) -> Path:
    """A PEFT adapter on the fused experts (``target_parameters``), with LoRA on
    ``target_modules`` too (e.g. attention); random A and B (``models.make_peft_adapter``)."""
    from tests.helpers.models import make_peft_adapter

    return make_peft_adapter(
        model_dir, out_dir, r=r, alpha=alpha, target_modules=list(target_modules), seed=seed,
        target_parameters=list(target_parameters), **kw,
    )  # fmt: skip


_ROLES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def to_per_expert(adapter_dir: str | Path, out_dir: str | Path, kind: str) -> Path:
    """``adapter_dir`` (``make_expert_adapter``'s form) rewritten in the per-expert
    ``target_modules`` form: expert e's rank-r pair of each projection under
    ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (Mixtral: ``block_sparse_moe`` and
    ``w1`` / ``w3`` / ``w2``). PEFT's fused A is (r*E, in) with expert e's rows e*r .. (e+1)*r,
    its B (out, r*E) with expert e's column j at j*E + e. Same deltas, same config otherwise."""
    from tests.helpers.models import write_adapter

    src = Path(adapter_dir)
    config = json.loads((src / "adapter_config.json").read_text())
    params = sorted(config.pop("target_parameters"), key=lambda p: "down" in p)  # model order
    tensors = load_file(src / "adapter_model.safetensors")
    mixtral = kind == "mixtral"
    parent = "block_sparse_moe" if mixtral else "mlp"
    experts = MOE_KINDS[kind][1].get("num_experts", MOE_KINDS[kind][1].get("num_local_experts"))
    out: dict[str, torch.Tensor] = {}
    fused = re.compile(r"^(.*\.layers\.\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_(A|B)\.weight$")
    for key, t in tensors.items():
        m = fused.match(key)
        if m is None:
            out[key] = t
            continue
        depth = m.group(2).count("base_layer")
        param = params[len(params) - 1 - depth].rsplit(".", 1)[-1]
        roles = ("gate", "up") if param == "gate_up_proj" else ("down",)
        for e in range(experts):
            if m.group(3) == "A":
                parts = [t.view(experts, -1, t.shape[1])[e]] * len(roles)
            else:
                be = t.view(t.shape[0], -1, experts)[:, :, e]  # (out, r)
                parts = list(be.chunk(len(roles), dim=0))
            for role, part in zip(roles, parts, strict=True):
                name = _ROLES[role][1 if mixtral else 0]
                out[f"{m.group(1)}.{parent}.experts.{e}.{name}.lora_{m.group(3)}.weight"] = (
                    part.contiguous().clone()
                )
    names = ["w1", "w2", "w3"] if mixtral else ["gate_proj", "up_proj", "down_proj"]
    config["target_modules"] = sorted(set(config.get("target_modules") or []) | set(names))
    return write_adapter(out_dir, config, out)
