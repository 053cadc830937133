"""Load a HF safetensors checkpoint (single file or sharded with an index) into the model.

Only safetensors is read: no pickle, no code from the model folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.llama import LlamaForCausalLM

__all__ = ["load_model", "ModelLoadError", "resolve_dtype"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF module -> (our fused module attribute, slice name or None)
_FUSED = {
    "self_attn.q_proj": ("qkv_proj", "q_proj"),
    "self_attn.k_proj": ("qkv_proj", "k_proj"),
    "self_attn.v_proj": ("qkv_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj", "o_proj"),
    "mlp.gate_proj": ("gate_up_proj", "gate_proj"),
    "mlp.up_proj": ("gate_up_proj", "up_proj"),
    "mlp.down_proj": ("down_proj", "down_proj"),
}


class ModelLoadError(RuntimeError):
    """The checkpoint is missing, incomplete or does not fit the config."""


def resolve_dtype(name: str, cfg: ModelConfig, device: str) -> torch.dtype:
    if name == "auto":
        if device == "cpu":
            return torch.float32
        name = cfg.torch_dtype or "bfloat16"
        if name == "float32":
            return torch.bfloat16  # serve fp32 checkpoints in bf16 on GPU, like vLLM
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(table)}")
    return table[name]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (only safetensors is supported)")
    return files


def _target(model: LlamaForCausalLM, name: str) -> torch.Tensor | None:
    """The tensor (or slice of a fused tensor) that checkpoint key ``name`` loads into."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens
    if name == "model.norm.weight":
        return model.norm.weight
    if name == "lm_head.weight":
        return None if model.cfg.tie_word_embeddings else model.lm_head
    m = _LAYER.match(name)
    if m is None:
        return None
    idx, rest = int(m.group(1)), m.group(2)
    if idx >= len(model.layers):
        raise ModelLoadError(f"checkpoint has layer {idx}, config has {len(model.layers)}")
    layer = model.layers[idx]
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return getattr(layer, rest.split(".")[0]).weight
    module, _, kind = rest.rpartition(".")
    if module not in _FUSED or kind not in ("weight", "bias"):
        return None
    attr, slice_name = _FUSED[module]
    fused = getattr(layer, attr)
    s = fused.slice_index(slice_name)
    lo, hi = fused.slice_offsets[s], fused.slice_offsets[s + 1]
    param = fused.weight if kind == "weight" else fused.bias
    if param is None:
        raise ModelLoadError(f"{name}: the config declares no bias for this module")
    return param[lo:hi]


def _expected(model: LlamaForCausalLM) -> dict[int, tuple[str, int]]:
    """data_ptr of each weight the checkpoint must fill -> (name, element count)."""
    units = [("model.embed_tokens", model.embed_tokens), ("model.norm", model.norm.weight)]
    if not model.cfg.tie_word_embeddings:
        units.append(("lm_head", model.lm_head))
    for i, layer in enumerate(model.layers):
        for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, attr)
            units.append((f"layers.{i}.{attr}.weight", lin.weight))
            if lin.bias is not None:
                units.append((f"layers.{i}.{attr}.bias", lin.bias))
        units.append((f"layers.{i}.input_layernorm", layer.input_layernorm.weight))
        units.append(
            (f"layers.{i}.post_attention_layernorm", layer.post_attention_layernorm.weight)
        )
    return {t.data_ptr(): (name, t.numel()) for name, t in units}


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    max_loras: int = 0,
    max_lora_rank: int = 16,
) -> LlamaForCausalLM:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(
        cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device
    )
    expected = _expected(model)
    filled: dict[int, int] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                dst = _target(model, key)
                if dst is None:
                    continue
                src = f.get_tensor(key)
                if tuple(src.shape) != tuple(dst.shape):
                    raise ModelLoadError(
                        f"{key}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}"
                    )
                with torch.no_grad():
                    dst.copy_(src.to(dtype))
                # a slice of a fused weight counts towards the unit it starts in
                unit = max((p for p in expected if p <= dst.data_ptr()), default=None)
                if unit is not None:
                    filled[unit] = filled.get(unit, 0) + dst.numel()
    missing = [name for p, (name, n) in expected.items() if filled.get(p, 0) < n]
    if missing:
        raise ModelLoadError(f"checkpoint in {path} lacks weights for: {', '.join(missing[:5])}")
    model.eval()
    return model
