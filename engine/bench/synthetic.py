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


def write_adapter(folder: Path, cfg: dict, *, rank: int, seed: int, device: str = "cpu") -> Path:
    """A rank-``rank`` PEFT LoRA on all seven linear modules of every layer, bf16; random
    values drawn on ``device`` (on a GPU, ~0.1 s for the 84 MB of the 8B shape)."""
    mcfg = ModelConfig.from_dict(cfg)
    shapes = mcfg.lora_module_shapes()
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for i in range(mcfg.num_layers):
        for m in LORA_MODULES:
            fan_in, fan_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.{_MODULE_PATH[m]}"
            a = torch.randn(rank, fan_in, generator=g, device=device) * fan_in**-0.5
            b = torch.randn(fan_out, rank, generator=g, device=device) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(LORA_MODULES),
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
