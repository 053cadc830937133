"""Build models through the registry, and load a HF safetensors checkpoint (single file or
sharded with an index) into one.

The model class comes from the registry (config.json's architecture), and so does the map from
checkpoint keys to its tensors. Only safetensors is read: no pickle, no code from the model
folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open

from loraplex.engine.model import registry
from loraplex.engine.model.config import ModelConfig

if TYPE_CHECKING:
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["build_model", "load_model", "ModelLoadError", "resolve_dtype"]


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


def build_model(
    cfg: ModelConfig,
    *,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """The model of ``cfg``'s family, weights uninitialised (``load_model`` fills them)."""
    model = registry.family(cfg.architecture).model(
        cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device
    )
    return cast("CausalLM", model)


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    max_loras: int = 0,
    max_lora_rank: int = 16,
) -> CausalLM:
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    model = build_model(
        cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device
    )
    weights = registry.family(cfg.architecture).weights
    # data_ptr of each weight the checkpoint must fill -> (name, element count)
    expected = {t.data_ptr(): (name, t.numel()) for name, t in weights.units(model)}
    filled: dict[int, int] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                dst = weights.target(model, key)
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
