"""qkv LoRA epilogue + Qwen3's per-head q / k RMSNorm (``lora_qk_norm``): Triton + torch twin.

Qwen3 normalises q and k per head after the projection (its LoRA delta included) and before
RoPE, so the qkv epilogue that adds the delta and applies RoPE (``lora_qkv_rope``) cannot run
on the GEMM's output directly. This op writes the normalised (T, N) projection; the fused
forward (``moe/forward.py``) then runs ``lora_qkv_rope`` on it with no LoRA (RoPE and the
paged KV write only). Loop form (``y_aug``, ``lora_b``, ``dora``: ``reference.py``'s)::

    for t:
        q, k, v = round(dora(y_aug[t, slice s]) + delta_s[t]) for s = 0, 1, 2, viewed (heads, D)
        for each head x of q (weight q_weight) and of k (k_weight):    # HF Qwen3 RMSNorm
            v32 = float(x); x = round(weight * round(v32 * rsqrt(mean(v32 * v32) + eps)))
        out[t] = (q, k, v) flattened

Grid ``(cdiv(T, BLOCK_T), Hq + 2 Hkv)``: one program per block of tokens and head (D
columns, one slice). Nothing but T shapes the launch (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
from loraplex.engine.model.lora.ops.delta import dora_rows_torch, lora_delta_torch

__all__ = ["lora_qk_norm", "lora_qk_norm_torch"]


def _check(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    out: torch.Tensor,
    num_heads: int,
) -> tuple[int, int]:
    """(head_dim D, KV heads) after checking shapes (no device sync)."""
    t, n = out.shape
    d = q_weight.shape[0]
    if tuple(k_weight.shape) != (d,) or q_weight.dim() != 1 or (n - num_heads * d) % (2 * d):
        raise ValueError(f"out {tuple(out.shape)}, q / k weights {d}, {num_heads} heads")
    if y_aug.dim() != 2 or y_aug.shape[0] != t or y_aug.shape[1] < n:
        raise ValueError(f"y_aug {tuple(y_aug.shape)}, want ({t}, >= {n})")
    if tuple(mapping.token_slots.shape) != (t,):
        raise ValueError(f"token_slots must have shape ({t},)")
    if lora_b is not None:
        rank = mapping.rank_rows(lora_b.shape[2])
        if lora_b.shape[1] != n or y_aug.shape[1] < n + 3 * lora_b.shape[0] * rank:
            raise ValueError(f"lora_b {tuple(lora_b.shape)} against y_aug {tuple(y_aug.shape)}")
    return d, (n // d - num_heads) // 2


def lora_qk_norm_torch(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    num_heads: int,
    dora: DoraRows | None = None,
) -> None:
    """The twin: the module docstring's loop."""
    t, n = out.shape
    d = q_weight.shape[0]
    q_size = num_heads * d
    bounds = (0, q_size, (n + q_size) // 2, n)
    parts = []
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        base = y_aug[:, lo:hi]
        if lora_b is None:
            parts.append(base)
            continue
        delta = lora_delta_torch(y_aug, n, lora_b, mapping, s, lo, hi, 3)
        y = (
            base.float()
            if dora is None
            else dora_rows_torch(base, dora, mapping.token_slots, lo, hi)
        )
        parts.append((y + delta).to(y_aug.dtype))
    normed = []
    for part, w in ((parts[0], q_weight), (parts[1], k_weight)):
        x32 = part.reshape(t, -1, d).float()
        x = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(out.dtype)
        normed.append((w.float() * x.float()).to(out.dtype).reshape(t, -1))
    out.copy_(torch.cat([normed[0], normed[1], parts[2].to(out.dtype)], dim=1))


def lora_qk_norm(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    num_heads: int,
    dora: DoraRows | None = None,
) -> None:
    """``out`` (T, N) = q, k (RMS-normalised per head) and v of the projection ``y_aug``
    with each row's LoRA delta; ``mapping.triton``: the kernel, else the twin."""
    _check(y_aug, lora_b, mapping, q_weight, k_weight, out, num_heads)
    args = (y_aug, lora_b, mapping, q_weight, k_weight, eps, out, num_heads, dora)
    if mapping.triton:
        from loraplex.engine.model.kernels.qk_norm_triton import lora_qk_norm_triton

        lora_qk_norm_triton(*args)
    else:
        lora_qk_norm_torch(*args)
