"""Triton: ``lora_add_rmsnorm`` with each row split over column chunks (large LoRA ranks).

The one-row-per-program kernel (add_rmsnorm.py) reads a row's whole B slice on one SM: at rank
64 that is 4096 x 64 x 2 bytes = 512 KB per row and launch, which one SM pulls from L2 at a
fraction of the chip's bandwidth (the fused epilogue got slower with rank, not the GEMMs). Here
grid ``(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))``: program ``(i, c)`` adds base + LoRA delta +
residual for columns ``c * BLOCK_H ..`` of the ``BLOCK_T`` rows of token block ``i``, stores the
new residual and each row's sum of squares over its chunk, then bumps the block's counter; the
last chunk of the block to arrive sums each row's partials in chunk order (the same bits
whatever the arrival order), normalises the block's rows, and resets the counter to 0 for the
next launch. Rows come grouped by slot (mapping.py), so a token block of a few rows mostly
shares one slot and reads its B chunk once instead of once per row; ``BLOCK_T >= 16`` takes the
delta as a tensor-core dot (``lora_delta``). Launches sharing the counters must not overlap (one stream runs the
forward, as for the fp8 GEMM's split-K). Semantics: ``reference.lora_add_rmsnorm_torch``.
Nothing but ``T`` shapes the launch (CUDA-graph safe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.workspace import per_device
from loraplex.engine.model.lora.ops.delta import (
    dora_args,
    dora_flags,
    dora_rows,
    lora_delta,
    lora_source,
)

if TYPE_CHECKING:
    from loraplex.engine.model.lora.mapping import DoraRows

__all__ = ["MAX_ROWS", "MAX_CHUNKS", "prepare_split_norm", "add_rmsnorm_split"]

MAX_ROWS = 256  # rows a split launch may have (decode batches); also its token blocks' counters
MAX_CHUNKS = 64  # column chunks per row
_work: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def prepare_split_norm(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(row counters (MAX_ROWS,) int32, zero between launches; partial sums (MAX_ROWS,
    MAX_CHUNKS) float32) of ``device``, allocated once outside any CUDA graph capture (the
    warm-up call before each capture allocates them)."""
    return per_device(
        _work, device,
        lambda d: (
            torch.zeros(MAX_ROWS, dtype=torch.int32, device=d),
            torch.zeros(MAX_ROWS, MAX_CHUNKS, dtype=torch.float32, device=d),
        ),
        "prepare_split_norm",
    )  # fmt: skip


@triton.jit
def _split_kernel(
    ya_ptr, res_ptr, b_ptr, slots_ptr, w_ptr, out_ptr, count_ptr, part_ptr,
    T, H, L, R, eps,
    stride_yt, stride_yn, stride_rt, stride_rn, stride_bl, stride_bn, stride_br,
    stride_slot, stride_w, stride_ot, stride_on,
    g_ptr, on_ptr, bias_ptr, stride_gl, stride_gn,
    NCHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_LORA: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_DORA: tl.constexpr,
    DORA_BIAS: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    chunk = tl.program_id(1)
    tok = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < T
    tok = tok.to(tl.int64)
    if HAS_LORA:
        slots = tl.load(slots_ptr + tok * stride_slot, mask=t_mask, other=-1).to(tl.int32)
    else:
        slots = tl.full((BLOCK_T,), -1, tl.int32)
    cols = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    c_mask = cols < H
    r_rows = res_ptr + tok[:, None] * stride_rt
    mask = t_mask[:, None] & c_mask[None, :]
    r = tl.load(r_rows + cols[None, :] * stride_rn, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(
        ya_ptr + tok[:, None] * stride_yt + cols[None, :] * stride_yn, mask=mask, other=0.0
    ).to(tl.float32)
    if HAS_LORA:
        acc = tl.full((BLOCK_T, BLOCK_H), 0.0, tl.float32)
        acc = lora_delta(
            acc, ya_ptr, b_ptr, tok, slots, cols, c_mask, H, 1, L, L, R,
            stride_yt, stride_yn, stride_bl, stride_bn, stride_br, BLOCK_R, USE_DOT,
        )  # fmt: skip
        if HAS_DORA:
            on, any_dora = dora_flags(on_ptr, slots)
            if any_dora:
                y = dora_rows(
                    y, on, g_ptr, bias_ptr, slots, cols, c_mask, stride_gl, stride_gn, DORA_BIAS
                )
        y = (y + acc).to(ya_ptr.dtype.element_ty).to(tl.float32)
    r = (r + y).to(res_ptr.dtype.element_ty)
    tl.store(r_rows + cols[None, :] * stride_rn, r, mask=mask)
    r = r.to(tl.float32)
    ss = tl.reduce(r * r, 1, tl.standard._sum_combine)  # (BLOCK_T,) this chunk's, per row
    tl.store(part_ptr + tok * NCHUNK + chunk, ss, mask=t_mask)
    tl.debug_barrier()  # every thread's residual and the partials are written before the release
    done = tl.atomic_add(count_ptr + blk, 1, sem="acq_rel", scope="gpu")
    if done == NCHUNK - 1:  # the block's last chunk: each row's sum in chunk order, the norm
        offs_c = tl.arange(0, BLOCK_C)
        parts = tl.load(
            part_ptr + tok[:, None] * NCHUNK + offs_c[None, :],
            mask=t_mask[:, None] & (offs_c < NCHUNK)[None, :], other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        sumsq = tl.reduce(parts, 1, tl.standard._sum_combine)  # (BLOCK_T,)
        tl.atomic_xchg(count_ptr + blk, 0, sem="relaxed", scope="gpu")
        inv = tl.rsqrt(sumsq / H + eps)[:, None]
        for h0 in range(0, H, BLOCK_H):
            cc = h0 + tl.arange(0, BLOCK_H)
            m = t_mask[:, None] & (cc < H)[None, :]
            v = tl.load(
                r_rows + cc[None, :] * stride_rn, mask=m, other=0.0, cache_modifier=".cg",
            ).to(tl.float32)  # fmt: skip
            normed = (v * inv).to(res_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + cc * stride_w, mask=cc < H, other=0.0).to(tl.float32)[None, :]
            o = (w * normed).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + tok[:, None] * stride_ot + cc[None, :] * stride_on, o, mask=m)


def add_rmsnorm_split(
    y_aug: torch.Tensor,
    residual: torch.Tensor,
    lora_b: torch.Tensor | None,
    token_slots: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    *,
    rank: int,
    block_h: int,
    block_r: int,
    num_warps: int,
    block_t: int = 1,
    dora: DoraRows | None = None,
) -> None:
    """The split launch (``T <= MAX_ROWS``, ``cdiv(H, block_h) <= MAX_CHUNKS``); ``rank``: the
    step's rank rows, ``block_r`` its chunk; ``block_t`` rows per program (>= 16: dot delta)."""
    t, h = residual.shape
    nchunk = triton.cdiv(h, block_h)
    if t > MAX_ROWS or nchunk > MAX_CHUNKS:
        raise ValueError(f"split norm: {t} rows x {nchunk} chunks over its workspace")
    counts, parts = prepare_split_norm(residual.device)
    b, b_strides, num_slots, _ = lora_source(lora_b, y_aug)
    has_lora = lora_b is not None
    d_args, (has_dora, dora_bias) = dora_args(dora if has_lora else None, y_aug)
    _split_kernel[(triton.cdiv(t, block_t), nchunk)](
        y_aug, residual, b, token_slots, norm_weight, out, counts, parts,
        t, h, num_slots, rank, eps,
        y_aug.stride(0), y_aug.stride(1), residual.stride(0), residual.stride(1), *b_strides,
        token_slots.stride(0), norm_weight.stride(0), out.stride(0), out.stride(1), *d_args,
        NCHUNK=nchunk,
        BLOCK_C=triton.next_power_of_2(nchunk),
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_R=block_r,
        HAS_LORA=has_lora,
        USE_DOT=block_t >= 16,
        HAS_DORA=has_dora,
        DORA_BIAS=dora_bias,
        num_warps=num_warps,
    )  # fmt: skip
