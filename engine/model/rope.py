"""Rotary position embedding (non-interleaved, HF layout) with Llama-3 and linear scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["RotaryEmbedding", "apply_rotary"]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to ``max_positions``, computed in float32."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        pos = torch.arange(max_positions, dtype=torch.float32)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                pos = pos / float(scaling["factor"])
        freqs = torch.outer(pos, inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, H, D), k: (T, Hkv, D); positions: (T,)."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def table(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)`` of shape (T, 1, D) for ``apply_rotary``: gathered once per step.

        ``signed_sin`` is sin with its first half negated, so rotate_half(x) * sin equals
        (x with its halves swapped) * signed_sin exactly (a negation is exact).
        """
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (T, heads, D) from ``RotaryEmbedding.table``; q and k heads may go together.

    Same values as ``RotaryEmbedding.forward`` in three ops instead of five per tensor.
    """
    t, heads, d = x.shape
    swapped = x.reshape(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    return torch.addcmul(x * cos, swapped, signed_sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
