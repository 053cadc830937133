"""Torch twins of the fused decode kernels: the CPU path and the oracle of the Triton kernels.

Shared inputs. ``y_aug`` (T, N + Rb * S * L) is the output of one augmented GEMM,
``x @ [W; A].T`` over the step's ``Rb = mapping.rank_rows(R)`` rank rows (model/lora/ranks.py): base
columns ``0 .. N`` then, rank-major (model/lora/layers.py), for rank ``r``, slice ``s`` and slot ``l``
the shrink ``y_aug[t, N + (r * S + s) * L + l] = x[t] . A[s, l, r]``. ``lora_b`` (L, N, R),
scale folded in, slice ``s`` owning rows ``lo_s .. hi_s``. ``mapping.token_slots`` (T,) int32,
-1 = base (no delta)::

    delta_s[t, j] = sum_{r < Rb} y_aug[t, N + (r * S + s) * L + slot_t] * lora_b[slot_t, lo_s + j, r]

DoRA (``dora``, ``mapping.DoraRows``, model/lora/dora.py): rows whose slot the projection's tables flag
read their base columns as ``dora(y) = g[slot] * (y - bias) + bias`` in fp32 (unrounded) before
the delta; other rows read ``y`` unchanged.

Rounding (``round`` = cast to the model dtype, ``y_aug``'s): the delta is summed in fp32 and
added to the upcast base output, then rounded once -- exactly where a separate LoRA expand
into the projection's output would round. Everything after follows HF's Llama ops step by
step, each torch op in the model dtype rounding its fp32 result; the Triton kernels emulate
those roundings, so both agree with HF up to fp32 summation order.

No host syncs, no data-dependent shapes except the cache write of ``qkv_rope_torch``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
from loraplex.engine.model.lora.ops.delta import dora_rows_torch, lora_delta_torch

__all__ = [
    "lora_add_rmsnorm_torch",
    "rmsnorm_torch",
    "lora_silu_mul_torch",
    "lora_qkv_rope_torch",
]


def _projection(
    y_aug: torch.Tensor,
    n_base: int,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    s: int,
    lo: int,
    hi: int,
    num_slices: int,
    dora: DoraRows | None = None,
) -> torch.Tensor:
    """``round(dora(y_aug[:, lo:hi]) + delta_s)`` in the model dtype (no delta, no DoRA
    without ``lora_b``)."""
    base = y_aug[:, lo:hi]
    if lora_b is None:
        return base
    delta = lora_delta_torch(y_aug, n_base, lora_b, mapping, s, lo, hi, num_slices)
    y = base.float() if dora is None else dora_rows_torch(base, dora, mapping.token_slots, lo, hi)
    return (y + delta).to(y_aug.dtype)


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out.copy_((weight.float() * normed.float()).to(out.dtype))


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """HF LlamaRMSNorm into ``out``. Loop form::

    for t: v = float(x[t]); out[t] = weight * round(v * rsqrt(mean(v * v) + eps))
    """
    _rmsnorm(x, weight, eps, out)


def lora_add_rmsnorm_torch(
    y_aug: torch.Tensor,
    residual: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    dora: DoraRows | None = None,
) -> None:
    """Projection epilogue + residual add + RMSNorm (S = 1 slice, N = H = residual width).
    Loop form::

    for t:
        y = round(dora(y_aug[t, :H]) + delta_0[t])    # no delta when lora_b is None
        residual[t] = round(residual[t] + y)          # in place, residual's dtype (HF: in dtype)
        v = float(residual[t])
        out[t] = weight * round(v * rsqrt(mean(v * v) + eps))
    """
    n_base = residual.shape[1]
    y = _projection(y_aug, n_base, lora_b, mapping, 0, 0, n_base, 1, dora)
    residual.copy_((residual.float() + y.float()).to(residual.dtype))
    _rmsnorm(residual, norm_weight, eps, out)


def lora_silu_mul_torch(
    y_aug: torch.Tensor,
    lora_b: torch.Tensor | None,
    mapping: LoRAMapping,
    out: torch.Tensor,
    dora: DoraRows | None = None,
) -> None:
    """gate_up epilogue + SiLU-and-mul (S = 2 slices of width I = out's width). Loop form::

    for t:
        g = round(dora(y_aug[t, :I]) + delta_0[t])    # gate: B rows 0 .. I
        u = round(dora(y_aug[t, I:2I]) + delta_1[t])  # up:   B rows I .. 2I
        out[t] = round(round(silu(g)) * u)            # HF: act_fn(gate) * up, silu in fp32
    """
    i = out.shape[1]
    g = _projection(y_aug, 2 * i, lora_b, mapping, 0, 0, i, 2, dora)
    u = _projection(y_aug, 2 * i, lora_b, mapping, 1, i, 2 * i, 2, dora)
    act = F.silu(g.float()).to(g.dtype)
    out.copy_((act.float() * u.float()).to(out.dtype))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lora_qkv_rope_torch(
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
    """qkv epilogue + rotary embedding + paged KV-cache write (S = 3 slices q, k, v); heads and
    head_dim D from ``q_out`` (T, Hq, D) and ``k_cache`` (blocks, block_size, Hkv, D). Loop form::

    for t:
        q, k, v = round(dora(y_aug[t, slice s]) + delta_s[t]) for s = 0, 1, 2, viewed (heads, D)
        c, sn = round(cos[positions[t]]), round(sin[positions[t]])    # fp32 tables -> dtype
        q, k = q * c + rotate_half(q) * sn, same for k   # HF order, each op rounded to dtype
        q_out[t] = q
        if slot_mapping[t] >= 0:                         # -1: padded row, no write
            blk, off = divmod(slot_mapping[t], block_size)
            k_cache[blk, off], v_cache[blk, off] = k, v
    """
    t, hq, head_dim = q_out.shape
    q_size, kv_size = hq * head_dim, k_cache.shape[2] * head_dim
    n_base = q_size + 2 * kv_size
    bounds = (0, q_size, q_size + kv_size, n_base)
    q, k, v = (
        _projection(y_aug, n_base, lora_b, mapping, s, lo, hi, 3, dora)
        for s, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))
    )
    q = q.reshape(t, -1, head_dim)
    k = k.reshape(t, -1, head_dim)
    v = v.reshape(t, -1, head_dim)
    c = cos[positions].unsqueeze(1).to(q.dtype)
    sn = sin[positions].unsqueeze(1).to(q.dtype)
    q_out.copy_(q * c + _rotate_half(q) * sn)
    k = k * c + _rotate_half(k) * sn
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = k[valid].to(k_cache.dtype)
    v_cache[slots // bs, slots % bs] = v[valid].to(v_cache.dtype)
