"""Triton: qkv LoRA epilogue + rotary embedding + paged KV-cache write (``lora_qkv_rope``).

Grid ``(cdiv(T, BLOCK_T), Hq + Hkv)``: program ``(i, h)`` owns ``BLOCK_T`` tokens and one head:
query head ``h < Hq`` (rotated, stored to ``q_out``), or KV head ``h - Hq`` (key rotated, key and
value stored to the caches at ``slot_mapping[t]``, skipped where it is -1). A head is handled
as its two halves, which ``rotate_half`` swaps. Semantics and roundings:
``reference.lora_qkv_rope_torch``. Nothing but ``T`` shapes the launch (CUDA-graph safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.launch_table import GENERIC, LaunchTable, Rule
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
from loraplex.engine.model.lora.ops.delta import (
    block_r,
    dora_args,
    dora_flags,
    dora_rows,
    lora_delta,
    lora_source,
)

__all__ = ["QKVRopeConfig", "QKV_ROPE_CONFIGS", "qkv_rope_config", "lora_qkv_rope_triton"]


@dataclass(frozen=True)
class QKVRopeConfig:
    block_t: int = 16
    num_warps: int = 4
    block_k: int = 0  # > 0: packed LoRA delta (one dot per BLOCK_K rank columns, lora_delta)


# sm_90 (``benchmarks/epilogue_configs.py``, bf16, D = 128): one token per program for small
# batches (adapters in parallel), 16-token blocks (tensor-core delta, B tiles shared within a
# block) beyond; the packed delta where it timed faster: 6.0 vs 6.4 µs at T = 64 with 8 slots,
# 7.6 vs 13.0 µs at T = 64 with 32; ptxas, R = 16: 86 registers (1 token, 4 warps), 128
# (16 tokens, 8 warps). Steps reading more than 16 rank rows with fewer than 16 slots (timed
# with 8; more slots keep the rank-16 choices) at small batches: two tokens per program (rows
# come grouped by slot, so the pair mostly shares its B tile), 8.9 against 14.3 µs at T = 32
# with 8 rank-64 slots; at T = 64 the per-slot loop on 16-token blocks, 9.8 against 13.5 µs
# for the packed delta.
_SM90: tuple[Rule[QKVRopeConfig], ...] = (
    Rule(QKVRopeConfig(2, 4), tokens=(None, 32), rank=(17, None), slots=(1, 15)),
    Rule(QKVRopeConfig(16, 4), tokens=(None, 64), rank=(17, None), slots=(1, 15)),
    Rule(QKVRopeConfig(1, 4), tokens=(None, 32)),
    Rule(QKVRopeConfig(16, 4, block_k=64), slots=(16, None), tokens=(None, 64)),
    Rule(QKVRopeConfig(16, 4, block_k=32), slots=(16, None)),
    Rule(QKVRopeConfig(16, 4, block_k=32), tokens=(None, 64), slots=(1, None)),
    Rule(QKVRopeConfig(16, 8)),
)
# Generic: the sm_90 rows. Their tiles take at most 34 KB of shared memory (compiled for sm_80,
# sm_86 and sm_90), so they run on any GPU; other GPUs' fastest configs were not measured.
QKV_ROPE_CONFIGS = LaunchTable("qkv_rope", {"sm90": _SM90, GENERIC: _SM90})


def qkv_rope_config(
    num_tokens: int, num_slots: int = 0, rank: int = 16, device: torch.device | str | None = None
) -> QKVRopeConfig:
    """The launch for ``num_tokens`` rows over ``num_slots`` slots reading ``rank`` rank rows
    on ``device`` (None: the generic rows); ``QKV_ROPE_CONFIGS``."""
    return QKV_ROPE_CONFIGS.pick(device, tokens=num_tokens, slots=num_slots, rank=rank)


@triton.jit
def _qkv_rope_kernel(
    ya_ptr, b_ptr, slots_ptr, pos_ptr, cos_ptr, sin_ptr,
    kc_ptr, vc_ptr, smap_ptr, q_ptr,
    T, Hq, q_size, kv_size, D, L, R, block_size,
    stride_yt, stride_yn, stride_bl, stride_bn, stride_br,
    stride_slot, stride_pos, stride_cp, stride_cd, stride_sp, stride_sd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_smap, stride_qt, stride_qh, stride_qd,
    g_ptr, on_ptr, bias_ptr, stride_gl, stride_gn,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_DORA: tl.constexpr,
    DORA_BIAS: tl.constexpr,
):  # fmt: skip
    dt = ya_ptr.dtype.element_ty
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < T
    tok = tok.to(tl.int64)
    head = tl.program_id(1)
    is_q = head < Hq
    kvh = head - Hq
    n_base = q_size + 2 * kv_size
    s = tl.where(is_q, 0, 1)
    col0 = tl.where(is_q, head * D, q_size + kvh * D)
    half = D // 2
    offs = tl.arange(0, BLOCK_HALF)
    h_mask = offs < half
    c1 = col0 + offs
    c2 = c1 + half
    mask = t_mask[:, None] & h_mask[None, :]
    y_rows = ya_ptr + tok[:, None] * stride_yt
    x1 = tl.load(y_rows + c1[None, :] * stride_yn, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(y_rows + c2[None, :] * stride_yn, mask=mask, other=0.0).to(tl.float32)
    if HAS_LORA:
        slots = tl.load(slots_ptr + tok * stride_slot, mask=t_mask, other=-1).to(tl.int32)
        d1 = tl.full((BLOCK_T, BLOCK_HALF), 0.0, tl.float32)
        d1 = lora_delta(
            d1, ya_ptr, b_ptr, tok, slots, c1, h_mask, n_base + s * L, 1, 3 * L, L, R,
            stride_yt, stride_yn, stride_bl, stride_bn, stride_br, BLOCK_R, USE_DOT, BLOCK_K,
        )  # fmt: skip
        d2 = tl.full((BLOCK_T, BLOCK_HALF), 0.0, tl.float32)
        d2 = lora_delta(
            d2, ya_ptr, b_ptr, tok, slots, c2, h_mask, n_base + s * L, 1, 3 * L, L, R,
            stride_yt, stride_yn, stride_bl, stride_bn, stride_br, BLOCK_R, USE_DOT, BLOCK_K,
        )  # fmt: skip
        if HAS_DORA:  # after the deltas: their loads go out before the flag gather
            on, any_dora = dora_flags(on_ptr, slots)
            if any_dora:
                x1 = dora_rows(
                    x1, on, g_ptr, bias_ptr, slots, c1, h_mask, stride_gl, stride_gn, DORA_BIAS
                )
                x2 = dora_rows(
                    x2, on, g_ptr, bias_ptr, slots, c2, h_mask, stride_gl, stride_gn, DORA_BIAS
                )
        x1 = (x1 + d1).to(dt).to(tl.float32)
        x2 = (x2 + d2).to(dt).to(tl.float32)

    # HF rotary in the model dtype: out = x * cos + rotate_half(x) * sin, every op rounded.
    pos = tl.load(pos_ptr + tok * stride_pos, mask=t_mask, other=0).to(tl.int64)
    cos_rows = cos_ptr + pos[:, None] * stride_cp
    sin_rows = sin_ptr + pos[:, None] * stride_sp
    cos1 = tl.load(cos_rows + offs[None, :] * stride_cd, mask=mask, other=0.0).to(dt)
    cos2 = tl.load(cos_rows + (half + offs)[None, :] * stride_cd, mask=mask, other=0.0).to(dt)
    sin1 = tl.load(sin_rows + offs[None, :] * stride_sd, mask=mask, other=0.0).to(dt)
    sin2 = tl.load(sin_rows + (half + offs)[None, :] * stride_sd, mask=mask, other=0.0).to(dt)
    a1 = (x1 * cos1.to(tl.float32)).to(dt).to(tl.float32)
    b1 = (x2 * sin1.to(tl.float32)).to(dt).to(tl.float32)
    a2 = (x2 * cos2.to(tl.float32)).to(dt).to(tl.float32)
    b2 = (x1 * sin2.to(tl.float32)).to(dt).to(tl.float32)
    o1 = (a1 - b1).to(dt)
    o2 = (a2 + b2).to(dt)

    if is_q:
        q_rows = q_ptr + tok[:, None] * stride_qt + head * stride_qh
        q_dt = q_ptr.dtype.element_ty
        tl.store(q_rows + offs[None, :] * stride_qd, o1.to(q_dt), mask=mask)
        tl.store(q_rows + (half + offs)[None, :] * stride_qd, o2.to(q_dt), mask=mask)
    else:
        slot = tl.load(smap_ptr + tok * stride_smap, mask=t_mask, other=-1).to(tl.int64)
        w_rows = t_mask & (slot >= 0)
        blk = slot // block_size
        off = slot % block_size
        k_rows = kc_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ko + kvh * stride_kh
        w_mask = w_rows[:, None] & h_mask[None, :]
        k_dt = kc_ptr.dtype.element_ty
        tl.store(k_rows + offs[None, :] * stride_kd, o1.to(k_dt), mask=w_mask)
        tl.store(k_rows + (half + offs)[None, :] * stride_kd, o2.to(k_dt), mask=w_mask)

        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        cv = q_size + kv_size + kvh * D + offs_d
        v = tl.load(
            y_rows + cv[None, :] * stride_yn, mask=t_mask[:, None] & d_mask[None, :], other=0.0
        ).to(tl.float32)
        if HAS_LORA:
            dv = tl.full((BLOCK_T, BLOCK_D), 0.0, tl.float32)
            dv = lora_delta(
                dv, ya_ptr, b_ptr, tok, slots, cv, d_mask, n_base + 2 * L, 1, 3 * L, L, R,
                stride_yt, stride_yn, stride_bl, stride_bn, stride_br, BLOCK_R, USE_DOT, BLOCK_K,
            )  # fmt: skip
            if HAS_DORA:  # noqa: SIM102 (any_dora exists only under the constexpr)
                if any_dora:
                    v = dora_rows(
                        v, on, g_ptr, bias_ptr, slots, cv, d_mask, stride_gl, stride_gn,
                        DORA_BIAS,
                    )  # fmt: skip
            v = (v + dv).to(dt)
        v_rows = vc_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vo + kvh * stride_vh
        tl.store(
            v_rows + offs_d[None, :] * stride_vd,
            v.to(vc_ptr.dtype.element_ty),
            mask=w_rows[:, None] & d_mask[None, :],
        )


def lora_qkv_rope_triton(
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
    *,
    config: QKVRopeConfig | None = None,
) -> None:
    """Triton ``lora_qkv_rope``; see ``reference.lora_qkv_rope_torch``."""
    t = y_aug.shape[0]
    if t == 0:
        return
    b, b_strides, num_slots, rank = lora_source(lora_b, y_aug)
    rank = mapping.rank_rows(rank)  # the step's rank rows (model/lora/ranks.py)
    cfg = config or qkv_rope_config(t, num_slots, rank, y_aug.device)
    use_dot = cfg.block_t >= 16
    min_n = 16 if use_dot else 1
    hq, head_dim, hkv = q_out.shape[1], q_out.shape[2], k_cache.shape[2]
    q_size, kv_size = hq * head_dim, hkv * head_dim
    slots = mapping.token_slots
    has_lora = lora_b is not None
    d_args, (has_dora, dora_bias) = dora_args(dora if has_lora else None, y_aug)
    grid = (triton.cdiv(t, cfg.block_t), hq + hkv)
    _qkv_rope_kernel[grid](
        y_aug, b, slots, positions, cos, sin, k_cache, v_cache, slot_mapping, q_out,
        t, hq, q_size, kv_size, head_dim, num_slots, rank, k_cache.shape[1],
        y_aug.stride(0), y_aug.stride(1), *b_strides,
        slots.stride(0),
        positions.stride(0), *cos.stride(), *sin.stride(),
        *k_cache.stride(), *v_cache.stride(),
        slot_mapping.stride(0), *q_out.stride(), *d_args,
        BLOCK_T=cfg.block_t,
        BLOCK_HALF=max(min_n, triton.next_power_of_2(head_dim // 2)),
        BLOCK_D=max(min_n, triton.next_power_of_2(head_dim)),
        BLOCK_R=block_r(
            rank, use_dot, cfg.block_t * triton.next_power_of_2(head_dim), cfg.num_warps
        ),
        HAS_LORA=has_lora,
        USE_DOT=use_dot,
        BLOCK_K=cfg.block_k if use_dot else 0,
        HAS_DORA=has_dora,
        DORA_BIAS=dora_bias,
        num_warps=cfg.num_warps,
        # HF rounds x * cos and rotate_half(x) * sin each to the model dtype before the sum:
        # no fused multiply-add may skip that rounding (with it, ~15 % of bf16 q / k elements
        # come out one unit off the twin)
        enable_fp_fusion=False,
    )  # fmt: skip
