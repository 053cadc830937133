"""The storm's base model and adapters: the shape of ``--shape``, its random weights, and
the adapters' files."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.coldload.adapters import TINY
from benchmarks.synthetic import LLAMA3_8B, random_model, write_adapter
from loraplex.engine.model.config import ModelConfig

__all__ = ["storm_model", "storm_shape", "write_adapters"]


def write_adapters(
    root: Path, cfg: dict, names: list[str], rank: int, device: str, experts: bool = True
) -> None:
    """Distinct rank-``rank`` all-module bf16 PEFT adapters, one folder per name (random
    weights drawn on ``device``: writing 88 x 84 MB from CPU randn would take minutes); on a
    mixture-of-experts shape, attention and (``experts``) every expert's gate_up and down."""
    for i, name in enumerate(names):
        write_adapter(root / name, cfg, rank=rank, seed=1234 + i, device=device, experts=experts)


def storm_shape(args: argparse.Namespace) -> dict:
    """The model config.json of ``--shape`` (``--layers``: the decoder layers cut)."""
    if args.shape == "llama3-8b":
        cfg = dict(TINY if args.smoke else LLAMA3_8B)
    else:
        from benchmarks.moe_decode import SHAPES

        cfg = dict(SHAPES["tiny" if args.smoke else args.shape])
        if args.smoke:  # (the smoke's streams outlast its windows: --max-tokens 1900)
            cfg["max_position_embeddings"] = 2048
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    return cfg


def storm_model(cfg: dict, args: argparse.Namespace, device: str) -> torch.nn.Module:
    """The random-weight model of ``cfg`` (bf16 on a GPU, float32 on the CPU)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    mc = ModelConfig.from_dict(cfg)
    if mc.moe is None:
        return random_model(
            cfg, max_loras=args.max_loras, max_lora_rank=args.rank, device=device, dtype=dtype
        )
    from benchmarks.moe_decode import random_moe

    return random_moe(mc, args.max_loras, device, max_lora_rank=args.rank)
