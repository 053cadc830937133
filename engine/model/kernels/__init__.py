"""Fused decode kernels: the LoRA expand folded into the elementwise op after each projection.

Each base projection is one "augmented" GEMM, ``y_aug = x @ [W; A].T`` of shape
(T, N + S * L * R): base output in columns ``0 .. N``, then the LoRA shrink of every slice
``s`` and slot ``l`` at ``y_aug[t, N + (s * L + l) * R + r]``. The op after the projection reads
it, adds each token's delta ``hA @ B[slot].T`` (``lora_b``: (L, N, R), scale folded in; slot -1
= base, no delta) and does its own work: residual add + RMSNorm, SiLU-and-mul, or rotary +
KV-cache write. Semantics and roundings: ``reference.py``.

Dispatch per call, like ``loraplex.engine.lora.ops``: ``LORAPLEX_FUSED_BACKEND=torch`` forces
the torch twins, ``=triton`` the Triton kernels (on CPU through ``TRITON_INTERPRET=1``);
otherwise Triton for CUDA tensors, the twins elsewhere. Triton is imported lazily. The checks
below read shapes only (no device sync), and the Triton launch depends on ``T`` alone, so the
GPU path can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from loraplex.engine.model.kernels.reference import (
    lora_add_rmsnorm_torch,
    lora_qkv_rope_torch,
    lora_silu_mul_torch,
    rmsnorm_torch,
)

__all__ = [
    "BACKEND_ENV",
    "lora_add_rmsnorm",
    "rmsnorm",
    "lora_silu_mul",
    "lora_qkv_rope",
    "lora_add_rmsnorm_torch",
    "rmsnorm_torch",
    "lora_silu_mul_torch",
    "lora_qkv_rope_torch",
]

BACKEND_ENV = "LORAPLEX_FUSED_BACKEND"


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(t: torch.Tensor) -> bool:
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced == "torch":
        return False
    if forced == "triton":
        return True
    if forced:
        raise ValueError(f"{BACKEND_ENV}={forced!r}: expected 'torch' or 'triton'")
    return t.is_cuda and _triton_available()


def _check_lora(
    y_aug: torch.Tensor,
    n_base: int,
    lora_b: torch.Tensor | None,
    token_slots: torch.Tensor | None,
    num_slots: int,
    rank: int,
    num_slices: int,
) -> None:
    if y_aug.dim() != 2 or y_aug.shape[1] < n_base:
        raise ValueError(f"y_aug {tuple(y_aug.shape)} has fewer than n_base={n_base} columns")
    if lora_b is None:
        return
    want = n_base + num_slices * num_slots * rank
    if y_aug.shape[1] < want:
        raise ValueError(f"y_aug {tuple(y_aug.shape)}: want >= {want} columns (N + S*L*R)")
    if tuple(lora_b.shape) != (num_slots, n_base, rank):
        raise ValueError(f"lora_b {tuple(lora_b.shape)}, want {(num_slots, n_base, rank)}")
    if lora_b.dtype != y_aug.dtype:
        raise ValueError(f"lora_b dtype {lora_b.dtype} != y_aug dtype {y_aug.dtype}")
    if token_slots is None or tuple(token_slots.shape) != (y_aug.shape[0],):
        raise ValueError(f"token_slots must have shape ({y_aug.shape[0]},)")


def lora_add_rmsnorm(
    y_aug: torch.Tensor,
    n_base: int,
    residual: torch.Tensor,
    lora_b: torch.Tensor | None,
    token_slots: torch.Tensor | None,
    num_slots: int,
    rank: int,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    """o_proj / down_proj epilogue, residual add, next RMSNorm (S = 1, ``n_base`` = H)::

    for t:
        y = round(y_aug[t, :H] + delta[t])          # no delta for slot -1 or lora_b None
        residual[t] = round(residual[t] + y)        # in place
        v = float(residual[t])
        out[t] = norm_weight * round(v * rsqrt(mean(v * v) + eps))
    """
    _check_lora(y_aug, n_base, lora_b, token_slots, num_slots, rank, 1)
    if residual.dim() != 2 or tuple(residual.shape) != (y_aug.shape[0], n_base):
        raise ValueError(f"residual {tuple(residual.shape)}, want {(y_aug.shape[0], n_base)}")
    if out.shape != residual.shape or tuple(norm_weight.shape) != (n_base,):
        raise ValueError(f"out {tuple(out.shape)}, norm_weight {tuple(norm_weight.shape)}")
    args = (y_aug, n_base, residual, lora_b, token_slots, num_slots, rank, norm_weight, eps, out)
    if _use_triton(y_aug):
        from loraplex.engine.model.kernels.add_rmsnorm import lora_add_rmsnorm_triton

        lora_add_rmsnorm_triton(*args)
    else:
        lora_add_rmsnorm_torch(*args)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """HF RMSNorm into ``out`` (first layer's input norm)::

    for t: v = float(x[t]); out[t] = weight * round(v * rsqrt(mean(v * v) + eps))
    """
    if x.dim() != 2 or out.shape != x.shape or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {out.shape}")
    if _use_triton(x):
        from loraplex.engine.model.kernels.add_rmsnorm import rmsnorm_triton

        rmsnorm_triton(x, weight, eps, out)
    else:
        rmsnorm_torch(x, weight, eps, out)


def lora_silu_mul(
    y_aug: torch.Tensor,
    n_base: int,
    lora_b: torch.Tensor | None,
    token_slots: torch.Tensor | None,
    num_slots: int,
    rank: int,
    out: torch.Tensor,
) -> None:
    """gate_up epilogue + SiLU-and-mul (S = 2 slices of width I = n_base / 2)::

    for t:
        g = round(y_aug[t, :I] + delta_gate[t]); u = round(y_aug[t, I:2I] + delta_up[t])
        out[t] = round(round(silu(g)) * u)
    """
    _check_lora(y_aug, n_base, lora_b, token_slots, num_slots, rank, 2)
    if n_base % 2 or tuple(out.shape) != (y_aug.shape[0], n_base // 2):
        raise ValueError(f"out {tuple(out.shape)}, want {(y_aug.shape[0], n_base // 2)}")
    args = (y_aug, n_base, lora_b, token_slots, num_slots, rank, out)
    if _use_triton(y_aug):
        from loraplex.engine.model.kernels.silu_mul import lora_silu_mul_triton

        lora_silu_mul_triton(*args)
    else:
        lora_silu_mul_torch(*args)


def lora_qkv_rope(
    y_aug: torch.Tensor,
    q_size: int,
    kv_size: int,
    head_dim: int,
    lora_b: torch.Tensor | None,
    token_slots: torch.Tensor | None,
    num_slots: int,
    rank: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor,
) -> None:
    """qkv epilogue + rotary (HF rotate_half) + paged KV write (S = 3: q, k, v)::

    for t:
        q, k, v = round(y_aug[t, slice s] + delta_s[t]), viewed (heads, head_dim)
        c, sn = round(cos[positions[t]]), round(sin[positions[t]])
        q_out[t] = q * c + rotate_half(q) * sn      # each op rounded, as in HF
        if slot_mapping[t] >= 0:
            blk, off = divmod(slot_mapping[t], block_size)
            k_cache[blk, off] = k * c + rotate_half(k) * sn; v_cache[blk, off] = v
    """
    t = y_aug.shape[0]
    n_base = q_size + 2 * kv_size
    _check_lora(y_aug, n_base, lora_b, token_slots, num_slots, rank, 3)
    hq, hkv = q_size // head_dim, kv_size // head_dim
    if head_dim % 2 or hq * head_dim != q_size or hkv * head_dim != kv_size:
        raise ValueError(f"q_size {q_size}, kv_size {kv_size}: not multiples of {head_dim}")
    if tuple(q_out.shape) != (t, hq, head_dim):
        raise ValueError(f"q_out {tuple(q_out.shape)}, want {(t, hq, head_dim)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != (hkv, head_dim):
            raise ValueError(f"{name} {tuple(c.shape)}, want (blocks, block_size, {hkv}, D)")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: want (P, {head_dim})")
    if tuple(positions.shape) != (t,) or tuple(slot_mapping.shape) != (t,):
        raise ValueError(f"positions / slot_mapping must have shape ({t},)")
    args = (y_aug, q_size, kv_size, head_dim, lora_b, token_slots, num_slots, rank)
    args2 = (positions, cos, sin, k_cache, v_cache, slot_mapping, q_out)
    if _use_triton(y_aug):
        from loraplex.engine.model.kernels.qkv_rope import lora_qkv_rope_triton

        lora_qkv_rope_triton(*args, *args2)
    else:
        lora_qkv_rope_torch(*args, *args2)
