"""Shared Triton helper: the LoRA expand of one (token block x column block) tile.

``y_aug`` holds, right of its ``n_base`` base columns, the shrink of every slice and slot,
rank-major (model/lora/layers.py): ``y_aug[t, n_base + (r * S + s) * L + slot] = x[t] . A[s, slot, r]``
for the step's ``R`` rank rows (its rank bound, model/lora/ranks.py; zero past each adapter's rank).
The delta of column ``n`` (a row of ``lora_b``, scale folded in) for token ``t`` is::

    delta[t, n] = sum_{r < R} y_aug[t, n_base + (r * S + s) * L + slot_t] * lora_b[slot_t, n, r]

and 0 for ``slot_t == -1``. Tokens of a block that share a slot share one load of its ``B`` tile:
the helper loops over the slots present in the block (``min .. max`` of its slots, skipping the
absent ones), masking ``hA`` rows of the other tokens to zero, and over the rank in chunks of
``BLOCK_R`` (so a rank-64 step keeps a rank-16 step's register tile instead of spilling). With
``USE_DOT`` (blocks of >= 16 tokens) each chunk is one tensor-core dot; otherwise a broadcast
multiply and a reduction. fp32 accumulation either way; the products of 16-bit inputs are exact.

``dora_rows`` applies DoRA's row scale (model/lora/dora.py, ``mapping.DoraRows``) to a tile of base
outputs before the delta is added: ``g * (y - bias) + bias`` for rows whose slot is flagged
(``dora_flags``), the tile unchanged (no scale load) for every other row; a block without
flagged rows skips it. The kernels call it after ``lora_delta``, so the delta's loads go out
before the flag gather and its branch: called first, the flag gather delayed the delta's loads
and the DoRA-capable graphs cost a step without DoRA rows up to +4 %; called after, +0.6-0.9 %.

Only Triton builtins (``tl.reduce`` with the standard combine functions, not ``tl.sum``): the
``@triton.jit`` library helpers are decorated when Triton is first imported, so with
``TRITON_INTERPRET=1`` set later they would refuse to run inside an interpreted kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping

__all__ = [
    "lora_delta",
    "dora_flags",
    "dora_rows",
    "dora_args",
    "lora_source",
    "block_r",
    "lora_delta_torch",
    "dora_rows_torch",
]


THREAD_ELEMS = 128  # fp32 products per thread of one broadcast chunk (R = 16 at 1 x 4096, 16 warps)


def block_r(rank: int, use_dot: bool, tile: int = 0, num_warps: int = 16) -> int:
    """Rank chunk: a power of two >= ``rank`` (at least 16 for ``tl.dot``); without dots, at
    most ``THREAD_ELEMS * threads / tile`` where ``tile`` = tokens x columns of the block."""
    full = max(16 if use_dot else 1, triton.next_power_of_2(max(rank, 1)))
    if use_dot or tile <= 0:
        return full
    return max(1, min(full, THREAD_ELEMS * 32 * num_warps // tile))


@triton.jit
def _mul_add(acc, h, b, USE_DOT: tl.constexpr):
    """``acc + h @ b`` in fp32: one tensor-core dot, or a broadcast multiply and a reduction."""
    if USE_DOT:
        acc += tl.dot(h, b.to(h.dtype), input_precision="ieee")
    else:
        prod = h.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]
        acc += tl.reduce(prod, 1, tl.standard._sum_combine)
    return acc


@triton.jit
def lora_delta(
    acc,
    ya_ptr,
    b_ptr,
    tok,
    slots,
    cols,
    col_mask,
    k_col,
    step_l,
    step_r,
    L,
    R,
    stride_yt,
    stride_yn,
    stride_bl,
    stride_bn,
    stride_br,
    BLOCK_R: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_K: tl.constexpr = 0,
):
    """``acc[i, j] += delta[tok[i], cols[j]]``; returns ``acc`` (fp32).

    tok: (BT,) int64 rows of ``y_aug``; slots: (BT,) int32, -1 for base or masked rows;
    cols: (BN,) rows of ``lora_b`` (= base columns of ``y_aug``), ``col_mask`` their validity;
    R: the step's rank rows (<= lora_b's last dimension). The shrink of (slot, r) is column
    ``k_col + slot * step_l + r * step_r`` of ``y_aug``: rank-major slice s of S (the fused
    epilogues) is ``(n_base + s * L, 1, S * L)``; slot-major shrinks (the vocab
    LoRA, model/lora/vocab.py) are ``(0, R, 1)``.

    ``BLOCK_K > 0`` (with ``USE_DOT``): "packed" form. The shrink columns of the slots a block
    spans (``lo .. hi``) are indexed rank-major, ``k = r * (hi - lo) + slot - lo``; each token
    keeps only its own slot's columns (masked load) and the delta is a dot over ``k`` in chunks
    of ``BLOCK_K`` against ``lora_b`` gathered as (R * span, N): one dot per chunk instead of
    one per slot. The same products as the per-slot loop; the fp32 sums in another order.

    Otherwise one gather per rank chunk loads every token's own shrinks; the loop over the
    slots present masks them per slot (the masked terms add exact zeros: the same sums, bit
    for bit, as a load per slot).
    """
    lo = tl.reduce(tl.where(slots >= 0, slots, L), 0, tl.standard._elementwise_min)
    hi = tl.reduce(slots, 0, tl.standard._elementwise_max) + 1
    h_rows = ya_ptr + tok[:, None] * stride_yt  # (BT, 1)
    if BLOCK_K > 0:
        # k = r * span + (slot - lo): one rank's shrinks of the block's slots are adjacent
        # columns of a rank-major y_aug (step_l = 1), so the loads of a chunk coalesce
        span = hi - lo
        offs = tl.arange(0, BLOCK_K)
        for k0 in range(0, R * span, BLOCK_K):
            k = k0 + offs
            k_r = k // span
            k_slot = lo + k % span
            k_ok = k < R * span
            h = tl.load(
                h_rows + (k_col + k_slot * step_l + k_r * step_r)[None, :] * stride_yn,
                mask=(slots[:, None] == k_slot[None, :]) & k_ok[None, :],
                other=0.0,
            )  # (BT, BLOCK_K)
            b = tl.load(
                b_ptr
                + k_slot[:, None] * stride_bl
                + k_r[:, None] * stride_br
                + cols[None, :] * stride_bn,
                mask=k_ok[:, None] & col_mask[None, :],
                other=0.0,
            )  # (BLOCK_K, BN)
            acc += tl.dot(h, b.to(h.dtype), input_precision="ieee")
        return acc
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        # every token's own shrinks of this rank chunk, in one gather (not one per slot)
        h_all = tl.load(
            h_rows + (k_col + slots[:, None] * step_l + offs_r[None, :] * step_r) * stride_yn,
            mask=(slots[:, None] >= 0) & r_mask[None, :],
            other=0.0,
        )  # (BT, BLOCK_R)
        for slot in range(lo, hi):
            sel = slots == slot
            if tl.reduce(sel.to(tl.int32), 0, tl.standard._elementwise_max) > 0:
                h = tl.where(sel[:, None], h_all, tl.zeros_like(h_all))
                b = tl.load(
                    b_ptr
                    + slot * stride_bl
                    + cols[None, :] * stride_bn
                    + offs_r[:, None] * stride_br,
                    mask=r_mask[:, None] & col_mask[None, :],
                    other=0.0,
                )  # (BLOCK_R, BN)
                acc = _mul_add(acc, h, b, USE_DOT)
    return acc


def lora_source(
    lora_b: torch.Tensor | None, dummy: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int, int], int, int]:
    """What a fused epilogue's ``b_ptr`` reads: ``(tensor, its three strides, slots L, rank
    R)``: ``lora_b`` (L, N, R), else ``dummy`` (never read)."""
    if lora_b is not None:
        return lora_b, lora_b.stride(), lora_b.shape[0], lora_b.shape[2]
    return dummy, (0, 0, 0), 0, 1


def dora_args(dora: DoraRows | None, dummy: torch.Tensor) -> tuple:
    """A kernel's DoRA arguments ``(g_ptr, on_ptr, bias_ptr, stride_gl, stride_gn)`` and its
    ``(HAS_DORA, DORA_BIAS)`` flags; ``dummy`` stands in for absent tensors (never read)."""
    if dora is None:
        return (dummy, dummy, dummy, 0, 0), (False, False)
    bias = dora.bias if dora.bias is not None else dummy
    if dora.bias is not None and dora.bias.stride(0) != 1:
        raise ValueError("DoRA bias must be contiguous")
    g = dora.scale
    return (g, dora.on, bias, g.stride(0), g.stride(1)), (True, dora.bias is not None)


@triton.jit
def dora_flags(on_ptr, slots):
    """(rows whose slot holds a DoRA adapter here (BT,) int1, whether any does): ``slots``
    (BT,) int32, -1 = none. The kernels skip ``dora_rows`` for blocks with none (one flag
    load per row is all a step without DoRA rows pays)."""
    live = slots >= 0
    on = tl.load(on_ptr + tl.where(live, slots, 0), mask=live, other=0) != 0
    return on, tl.reduce(on.to(tl.int32), 0, tl.standard._elementwise_max) > 0


@triton.jit
def dora_rows(
    y,
    on,
    g_ptr,
    bias_ptr,
    slots,
    cols,
    col_mask,
    stride_gl,
    stride_gn,
    HAS_BIAS: tl.constexpr,
):
    """``y`` (BT, BN) fp32 base outputs (bias included) of columns ``cols``: rows ``on``
    flags (``dora_flags``) get ``g[slot, cols] * (y - bias) + bias`` in fp32; the others are
    returned unchanged. Returns the tile."""
    m = on[:, None] & col_mask[None, :]
    g = tl.load(
        g_ptr + slots.to(tl.int64)[:, None] * stride_gl + cols[None, :] * stride_gn,
        mask=m,
        other=1.0,
    ).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out = tl.where(m, g * (y - b) + b, y)
    else:
        out = y * g
    return out


# -- torch twins (the CPU path and the kernels' oracle; model/kernels/reference.py's) ----------


def lora_delta_torch(
    y_aug: torch.Tensor,
    n_base: int,
    lora_b: torch.Tensor,
    mapping: LoRAMapping,
    s: int,
    lo: int,
    hi: int,
    num_slices: int = 1,
) -> torch.Tensor:
    """fp32 (T, hi - lo): ``delta_s`` of the module docstring for B rows ``lo .. hi``, slice
    ``s`` of ``num_slices``.

    One matmul over all slots: the shrink columns of other slots are masked to zero.
    """
    t = y_aug.shape[0]
    num_slots = lora_b.shape[0]
    rank = mapping.rank_rows(lora_b.shape[2])
    cols = y_aug[:, n_base : n_base + rank * num_slices * num_slots].float()
    h = cols.view(t, rank, num_slices, num_slots)[:, :, s].transpose(1, 2)  # (T, L, Rb)
    own = mapping.token_slots.long().unsqueeze(1) == torch.arange(num_slots, device=y_aug.device)
    h = (h * own.unsqueeze(2)).reshape(t, num_slots * rank)  # (T, L*R)
    b = lora_b[:, lo:hi, :rank].float().permute(0, 2, 1).reshape(num_slots * rank, hi - lo)
    return h @ b


def dora_rows_torch(
    y: torch.Tensor, dora: DoraRows, token_slots: torch.Tensor, lo: int, hi: int
) -> torch.Tensor:
    """fp32 (T, hi - lo): base columns ``lo .. hi`` (``y``, any dtype) with the DoRA row scale
    on the rows of flagged slots (module docstring), the others unchanged."""
    idx = token_slots.long()  # -1: the last row (ones, never flagged)
    on = ((dora.on[idx] != 0) & (idx >= 0)).unsqueeze(1)
    y = y.float()
    g = dora.scale[idx, lo:hi].float()
    if dora.bias is None:
        return torch.where(on, g * y, y)
    b = dora.bias[lo:hi].float()
    return torch.where(on, g * (y - b) + b, y)
