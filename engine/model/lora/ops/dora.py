"""The DoRA row scale on a projection's base output (model/lora/dora.py says what it is)."""

from __future__ import annotations

import torch

__all__ = ["apply_dora"]


def apply_dora(
    y: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, token_slots: torch.Tensor
) -> None:
    """In place, per row t: y[t] <- g[slot[t]] * (y[t] - bias) + bias, g = ``scale`` (L + 1, N)
    (row -1 is ones: base rows). ``y``: (T, N) base output (bias included), no delta yet."""
    g = scale[token_slots.long()]  # (T, N)
    if bias is None:
        y.mul_(g)
    else:
        y.sub_(bias).mul_(g).add_(bias)
