"""Random-weight models and PEFT adapter folders for benchmarks (no checkpoints needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.engine.model.config import LORA_MODULES, ModelConfig
from loraplex.engine.model.llama import LlamaForCausalLM

LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

_MODULE_PATH = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def write_model_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@torch.no_grad()
def random_model(
    cfg: dict,
    *,
    max_loras: int,
    max_lora_rank: int,
    device: str = "cuda",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> LlamaForCausalLM:
    """Build the model on the device and fill it with random weights (std ~ 1/sqrt(fan_in))."""
    mcfg = ModelConfig.from_dict(cfg)
    model = LlamaForCausalLM(
        mcfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device
    )
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in model.layers:
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            w = lin.weight
            w.normal_(0.0, lin.in_features**-0.5, generator=g)
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    model.embed_tokens.normal_(0.0, 1.0, generator=g)
    if not mcfg.tie_word_embeddings:
        model.lm_head.normal_(0.0, mcfg.hidden_size**-0.5, generator=g)
    model.norm.weight.fill_(1.0)
    return model


def write_adapter(
    folder: Path, cfg: dict, *, rank: int, seed: int, device: str = "cpu", experts: bool = True
) -> Path:
    """A rank-``rank`` PEFT LoRA on all seven linear modules of every layer, bf16; random
    values drawn on ``device`` (on a GPU, ~0.1 s for the 84 MB of the 8B shape).

    A mixture-of-experts ``cfg`` (Qwen3-MoE, Mixtral): q / k / v / o of every layer, the dense
    MLP modules of its dense layers and, with ``experts``, every sparse layer's experts in
    PEFT's ``target_parameters`` form (``mlp.experts.gate_up_proj`` / ``down_proj``: one
    rank-``rank`` pair per expert; moe/lora_names.py)."""
    mcfg = ModelConfig.from_dict(cfg)
    shapes = mcfg.lora_module_shapes()
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}

    def pair(key: str, fan_in: int, fan_out: int, rows: int) -> None:
        a = torch.randn(rows, fan_in, generator=g, device=device) * fan_in**-0.5
        b = torch.randn(fan_out, rows, generator=g, device=device) * 0.01
        tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
        tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).cpu()

    modules = [
        m for m in LORA_MODULES if any(mcfg.has_module(i, m) for i in range(mcfg.num_layers))
    ]
    for i in range(mcfg.num_layers):
        for m in modules:
            if mcfg.has_module(i, m):
                pair(f"base_model.model.model.layers.{i}.{_MODULE_PATH[m]}", *shapes[m], rank)
        if experts and mcfg.moe is not None and mcfg.moe.is_sparse(i):
            # PEFT nests its parameter wrappers in the model's parameter order: gate_up (the
            # first) is the innermost, ``experts.base_layer``
            key = f"base_model.model.model.layers.{i}.mlp.experts"
            for name, at in (("gate_up_proj", f"{key}.base_layer"), ("down_proj", key)):
                fan_in, fan_out, e = mcfg.expert_module_shape(f"experts.{name}")  # type: ignore[misc]
                pair(at, fan_in, fan_out, rank * e)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    if experts and mcfg.moe is not None:
        config["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
