"""The bandwidth floor of a decode step: the bytes it must read (base weights as the engine
holds them, adapters, KV) over the device's measured copy bandwidth; shared by the decode
benchmarks (``decode.py``, ``mixed_rank.py``, ``base_configs.py``)."""

from __future__ import annotations

import torch

__all__ = ["base_bytes", "copy_bandwidth", "kv_bytes", "pct"]


def copy_bandwidth() -> float:
    if not torch.cuda.is_available():
        return 1e11  # nominal, for --smoke on CPU
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        y.copy_(x)
    e1.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (e0.elapsed_time(e1) / 1e3)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def kv_bytes(cfg: dict, batch: int, ctx: int) -> int:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_tok = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    return batch * ctx * per_tok


def base_bytes(model) -> int:
    """Bytes of base weights one decode step reads (an fp8 projection: its fp8 rows and
    float32 scales; call after the engine started, which frees the float rows)."""
    total = 0
    for name, p in model.named_parameters():
        if name == "embed_tokens":
            continue  # decode gathers a few rows only
        if name.endswith("weight_aug"):
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            if not mod.float_base:
                total += mod.weight_fp8.numel() + mod.weight_scale.numel() * 4
                continue
            total += mod.out_features * mod.in_features * p.element_size()
        elif name.endswith("bias_aug"):
            continue
        else:
            total += p.numel() * p.element_size()
    return total
