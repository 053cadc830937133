"""Fused decode kernels: the LoRA expand folded into the elementwise op after each projection.

Each base projection is one "augmented" GEMM, ``y_aug = x @ [W; A].T`` of shape
(T, N + Rb * S * L): base output in columns ``0 .. N``, then the LoRA shrink of every slice
``s`` and slot ``l``, rank-major, at ``y_aug[t, N + (r * S + s) * L + l]`` for the step's
``Rb = mapping.rank_rows(R)`` rank rows (model/lora/ranks.py). The op after the projection reads
it, adds each token's delta ``hA @ B[slot].T`` (``lora_b``: (L, N, R), scale folded in; slot -1
= base, no delta) and does its own work: residual add + RMSNorm, SiLU-and-mul, or rotary +
KV-cache write. Semantics and roundings: ``reference.py``.

Every op takes the step's ``LoRAMapping`` (``model/lora/mapping.py``): its ``token_slots`` (T,) say
which slot each row uses, its ``triton`` flag which implementation runs, the Triton kernel (on
CPU through ``TRITON_INTERPRET=1``) or the torch twin. The twins (``reference.py``) and the
Triton wrappers take exactly the arguments of the op here; sizes (L, N, R, heads, head_dim)
come from the tensors' shapes. ``dora`` (``DoraRows``, model/lora/dora.py): the projection's DoRA
row scales, applied to the base output of rows whose slot is flagged before the delta (None: no
DoRA). Triton is imported lazily. The checks below read shapes only (no device sync), and the
Triton launch depends on ``T`` alone, so the GPU path can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from loraplex.engine.model.kernels.reference import (
    lora_add_rmsnorm_torch,
    lora_qkv_rope_torch,
    lora_silu_mul_torch,
    rmsnorm_torch,
)
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping

__all__ = [
    "lora_add_rmsnorm",
    "rmsnorm",
    "lora_silu_mul",
    "lora_qkv_rope",
    "lora_add_rmsnorm_torch",
    "rmsnorm_torch",
    "lora_silu_mul_torch",
    "lora_qkv_rope_torch",
]


def _check_lora(
    y_aug: torch.Tensor,
    n_base: int,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    num_slices: int,
    dora: DoraRows | None = None,
) -> None:
    if y_aug.dim() != 2 or y_aug.shape[1] < n_base:
        raise ValueError(f"y_aug {tuple(y_aug.shape)} has fewer than n_base={n_base} columns")
    if lora_b is None:
        return
    if lora_b.dim() != 3 or lora_b.shape[1] != n_base:
        raise ValueError(f"lora_b {tuple(lora_b.shape)}, want (L, {n_base}, R)")
    num_slots, _, rank = lora_b.shape
    want = n_base + num_slices * num_slots * mapping.rank_rows(rank)
    if y_aug.shape[1] < want:
        raise ValueError(f"y_aug {tuple(y_aug.shape)}: want >= {want} columns (N + S*L*Rb)")
    if lora_b.dtype != y_aug.dtype:
        raise ValueError(f"lora_b dtype {lora_b.dtype} != y_aug dtype {y_aug.dtype}")
    if dora is not None and (
        tuple(dora.scale.shape) != (num_slots + 1, n_base)
        or tuple(dora.on.shape) != (num_slots + 1,)
        or (dora.bias is not None and tuple(dora.bias.shape) != (n_base,))
    ):
        raise ValueError(f"DoRA tables {tuple(dora.scale.shape)}, want ({num_slots + 1}, {n_base})")
    if tuple(mapping.token_slots.shape) != (y_aug.shape[0],):
        raise ValueError(f"token_slots must have shape ({y_aug.shape[0]},)")


def lora_add_rmsnorm(
    y_aug: torch.Tensor,
    residual: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    dora: DoraRows | None = None,
) -> None:
    """o_proj / down_proj epilogue, residual add, next RMSNorm (S = 1, N = H = residual width)::

    for t:
        y = round(dora(y_aug[t, :H]) + delta[t])    # no delta for slot -1 or lora_b None
        residual[t] = round(residual[t] + y)        # in place
        v = float(residual[t])
        out[t] = norm_weight * round(v * rsqrt(mean(v * v) + eps))
    """
    if residual.dim() != 2 or residual.shape[0] != y_aug.shape[0]:
        raise ValueError(f"residual {tuple(residual.shape)}, want ({y_aug.shape[0]}, H)")
    n_base = residual.shape[1]
    _check_lora(y_aug, n_base, lora_b, mapping, 1, dora)
    if out.shape != residual.shape or tuple(norm_weight.shape) != (n_base,):
        raise ValueError(f"out {tuple(out.shape)}, norm_weight {tuple(norm_weight.shape)}")
    args = (y_aug, residual, lora_b, mapping, norm_weight, eps, out, dora)
    if mapping.triton:
        from loraplex.engine.model.kernels.add_rmsnorm import lora_add_rmsnorm_triton

        lora_add_rmsnorm_triton(*args)
    else:
        lora_add_rmsnorm_torch(*args)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, *, triton: bool
) -> None:
    """HF RMSNorm into ``out`` (first layer's input norm); ``triton``: the step's choice::

    for t: v = float(x[t]); out[t] = weight * round(v * rsqrt(mean(v * v) + eps))
    """
    if x.dim() != 2 or out.shape != x.shape or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {out.shape}")
    if triton:
        from loraplex.engine.model.kernels.add_rmsnorm import rmsnorm_triton

        rmsnorm_triton(x, weight, eps, out)
    else:
        rmsnorm_torch(x, weight, eps, out)


def lora_silu_mul(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    out: torch.Tensor,
    dora: DoraRows | None = None,
) -> None:
    """gate_up epilogue + SiLU-and-mul (S = 2 slices of width I = out's width, N = 2I)::

    for t:
        g = round(dora(y_aug[t, :I]) + delta_gate[t]); u = round(dora(y_aug[t, I:2I]) + delta_up[t])
        out[t] = round(round(silu(g)) * u)
    """
    if out.dim() != 2 or out.shape[0] != y_aug.shape[0]:
        raise ValueError(f"out {tuple(out.shape)}, want ({y_aug.shape[0]}, I)")
    _check_lora(y_aug, 2 * out.shape[1], lora_b, mapping, 2, dora)
    args = (y_aug, lora_b, mapping, out, dora)
    if mapping.triton:
        from loraplex.engine.model.kernels.silu_mul import lora_silu_mul_triton

        lora_silu_mul_triton(*args)
    else:
        lora_silu_mul_torch(*args)


def lora_qkv_rope(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor,
    dora: DoraRows | None = None,
) -> None:
    """qkv epilogue + rotary (HF rotate_half) + paged KV write (S = 3: q, k, v)::

    for t:                                          # heads and D from q_out, k_cache
        q, k, v = round(dora(y_aug[t, slice s]) + delta_s[t]), viewed (heads, D)
        c, sn = round(cos[positions[t]]), round(sin[positions[t]])
        q_out[t] = q * c + rotate_half(q) * sn      # each op rounded, as in HF
        if slot_mapping[t] >= 0:
            blk, off = divmod(slot_mapping[t], block_size)
            k_cache[blk, off] = k * c + rotate_half(k) * sn; v_cache[blk, off] = v
    """
    t = y_aug.shape[0]
    if q_out.dim() != 3 or q_out.shape[0] != t:
        raise ValueError(f"q_out {tuple(q_out.shape)}, want ({t}, Hq, D)")
    hq, head_dim = q_out.shape[1], q_out.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != head_dim or c.shape != k_cache.shape:
            raise ValueError(f"{name} {tuple(c.shape)}, want (blocks, block_size, Hkv, {head_dim})")
    _check_lora(y_aug, (hq + 2 * k_cache.shape[2]) * head_dim, lora_b, mapping, 3, dora)
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim:
        raise ValueError(f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: want (P, {head_dim})")
    if tuple(positions.shape) != (t,) or tuple(slot_mapping.shape) != (t,):
        raise ValueError(f"positions / slot_mapping must have shape ({t},)")
    args = (
        y_aug, lora_b, mapping, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out, dora,
    )  # fmt: skip
    if mapping.triton:
        from loraplex.engine.model.kernels.qkv_rope import lora_qkv_rope_triton

        lora_qkv_rope_triton(*args)
    else:
        lora_qkv_rope_torch(*args)
