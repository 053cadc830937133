"""The model under study and its synthetic PEFT adapters.

``write_adapter_set`` makes N full PEFT folders (``adapter_config.json`` +
``adapter_model.safetensors``), each under its own name; with ``distinct=K`` only K weight
files exist and the N folders hardlink them, so 1000 adapters cost K files of disk. The engine
still treats every name as its own adapter (its own load, digest, slot).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex.engine.bench.coldload.config import PointConfig
from loraplex.engine.bench.synthetic import LLAMA3_8B, random_model
from loraplex.engine.model.config import LORA_MODULES, ModelConfig

__all__ = [
    "TINY",
    "AdapterSet",
    "adapter_names",
    "build_model",
    "model_config",
    "resolve_device",
    "write_adapter_set",
]

TINY: dict[str, Any] = dict(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)
_SHAPES = {"tiny": TINY, "llama3-8b": LLAMA3_8B}
_PARENT = {
    m: "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn" for m in LORA_MODULES
}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def model_config(point: PointConfig) -> dict[str, Any]:
    """The HF config dict of the model: the checkpoint's config.json or a synthetic shape."""
    if point.model is not None:
        return json.loads((Path(point.model) / "config.json").read_text())
    return dict(_SHAPES[point.synthetic])


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_model(point: PointConfig, cfg: dict[str, Any]) -> Any:
    """A random-weight model for synthetic points (blocking); None for a checkpoint."""
    if point.model is not None:
        return None
    device = resolve_device(point.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        point.dtype, torch.bfloat16 if device.startswith("cuda") else torch.float32
    )
    return random_model(
        cfg,
        max_loras=point.max_loras,
        max_lora_rank=point.rank,
        device=device,
        seed=point.seed,
        dtype=dtype,
    )


def adapter_names(n: int) -> list[str]:
    """``a000`` ... : valid adapter names that sort in popularity order (rank 1 first)."""
    width = len(str(max(n - 1, 0)))
    return [f"a{i:0{width}d}" for i in range(n)]


@dataclass
class AdapterSet:
    """N adapter folders ``root/<name>/`` made for one ``PointConfig.adapter_key()``."""

    root: Path
    names: list[str]
    folder_bytes: int  # bytes of one adapter folder (what a fetch moves)
    weight_bytes: int  # bytes of one weights file
    distinct: int

    def folder(self, name: str) -> Path:
        return self.root / name


def _weights(cfg: dict[str, Any], rank: int, targets: tuple[str, ...], seed: int) -> dict:
    mcfg = ModelConfig.from_dict(cfg)
    shapes = mcfg.lora_module_shapes()
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(mcfg.num_layers):
        for m in targets:
            fan_in, fan_out = shapes[m]
            key = f"base_model.model.model.layers.{i}.{_PARENT[m]}.{m}"
            a = torch.randn(rank, fan_in, generator=g) * fan_in**-0.5
            b = torch.randn(fan_out, rank, generator=g) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    return tensors


def write_adapter_set(
    dest: Path,
    cfg: dict[str, Any],
    *,
    num: int,
    rank: int,
    targets: tuple[str, ...],
    distinct: int = 0,
    seed: int = 0,
) -> AdapterSet:
    """Write ``num`` PEFT folders under ``dest/adapters`` (weights in ``dest/blobs``, linked)."""
    bad = [t for t in targets if t not in LORA_MODULES]
    if bad or not targets:
        raise ValueError(f"targets must be a non-empty subset of {LORA_MODULES}, got {targets}")
    k = min(distinct or num, num)
    blobs, root = dest / "blobs", dest / "adapters"
    blobs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for j in range(k):
        p = blobs / f"w{j}.safetensors"
        if not p.exists():
            save_file(_weights(cfg, rank, targets, seed * 100_003 + j), str(p))
        paths.append(p)
    config = json.dumps(
        {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(targets),
            "bias": "none",
            "lora_dropout": 0.0,
            "task_type": "CAUSAL_LM",
        }
    )
    names = adapter_names(num)
    for i, name in enumerate(names):
        folder = root / name
        folder.mkdir(exist_ok=True)
        (folder / CONFIG_FILE).write_text(config)
        target = folder / WEIGHTS_FILE
        if not target.exists():
            os.link(paths[i % k], target)
    weight_bytes = paths[0].stat().st_size
    return AdapterSet(root, names, weight_bytes + len(config), weight_bytes, k)
