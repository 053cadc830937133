"""Tiny PEFT-style adapters written with safetensors directly (no transformers, no downloads)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex.engine.model.config import ModelConfig

__all__ = ["TINY_MODEL", "tiny_model_config", "write_adapter", "write_raw_safetensors"]

TINY_MODEL: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
}
_PARENT = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def tiny_model_config() -> ModelConfig:
    return ModelConfig.from_dict(dict(TINY_MODEL))


def write_adapter(
    folder: Path,
    *,
    rank: int = 4,
    targets: Sequence[str] = ("q_proj", "v_proj", "down_proj"),
    dtype: torch.dtype = torch.float32,
    adapter_name: str | None = None,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write adapter_config.json + adapter_model.safetensors for the tiny model into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    mc = tiny_model_config()
    gen = torch.Generator().manual_seed(seed)
    if tensors is None:
        tensors = {}
        infix = f".{adapter_name}" if adapter_name else ""
        for layer in range(mc.num_layers):
            for module in targets:
                d_in, d_out = mc.lora_module_shapes()[module]
                base = f"base_model.model.model.layers.{layer}.{_PARENT.get(module, 'self_attn')}"
                a = torch.randn(rank, d_in, generator=gen).to(dtype)
                b = torch.randn(d_out, rank, generator=gen).to(dtype)
                tensors[f"{base}.{module}.lora_A{infix}.weight"] = a
                tensors[f"{base}.{module}.lora_B{infix}.weight"] = b
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    cfg.update(config or {})
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def write_raw_safetensors(
    path: Path, header: dict[str, Any], data: bytes, *, header_len: int | None = None
) -> None:
    """Write a safetensors file byte by byte (for corrupt files); ``header_len`` overrides."""
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(n.to_bytes(8, "little") + raw + data)
