"""Triton grouped LoRA shrink: ``out[s, t, :rank] = x[t] @ A[s, slot(t), :rank].T`` for all
segments and slices in one launch.

Grid: ``(token tiles of the longest segment, segments, slices * split_k)``. Each program gathers
up to ``BLOCK_M`` rows of ``x`` through ``sorted_token_ids``, walks its share of the ``in``
dimension (split-K interleaved by ``BLOCK_K``), and writes (or, with split-K, atomically adds
into a zeroed ``out``) a ``(BLOCK_M, BLOCK_R)`` tile masked to the segment's rank.

The kernels here use only Triton builtins, no ``@triton.jit`` library helpers (``tl.zeros``):
those are decorated when Triton is first imported, so under ``TRITON_INTERPRET=1`` set after
that import they would refuse to run inside an interpreted kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.launch_table import (
    GENERIC,
    GENERIC_SMEM_BYTES,
    LaunchTable,
    Rule,
    device_sms,
)
from loraplex.engine.model.lora.mapping import LoRAMapping

__all__ = ["SHRINK_CONFIGS", "ShrinkConfig", "shrink_config", "shrink_triton", "smem_bytes"]


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int = 16
    block_r: int = 16
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


def smem_bytes(cfg: ShrinkConfig, elem: int = 4) -> int:
    """Shared memory a launch of ``cfg`` asks: x and A^T tiles per pipeline stage (``elem``:
    bytes per element; 4, float32 inputs, bounds every dtype)."""
    return cfg.num_stages * (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_r) * elem


def _tiles(shape: Mapping[str, int], smem: int | None = None) -> ShrinkConfig:
    """Tile sizes and split-K so that small (decode) batches still fill the device's SMs;
    ``smem``: a shared-memory budget the tiles keep within (narrower K, then M tiles)."""
    # Register budget (sm_90, bf16): 16x16x64 @4 warps ~72 regs, 64x16x64 @8 warps ~80,
    # 64x64x32 @8 warps ~130. Per-element gather pointers dominate, so tiles stay modest.
    seg_len = max(shape["tokens"], 1)
    block_m = min(64, max(16, triton.next_power_of_2(seg_len)))
    block_r = max(16, triton.next_power_of_2(shape["rank"]))
    block_k = 64 if block_r <= 32 else 32
    if smem is not None:  # (only very large ranks get here: rank 256 in float32 fits)
        while smem_bytes(ShrinkConfig(block_m, block_r, block_k)) > smem and block_k > 16:
            block_k //= 2
        while smem_bytes(ShrinkConfig(block_m, block_r, block_k)) > smem and block_m > 16:
            block_m //= 2
    num_warps = 8 if block_m >= 64 else 4
    base = triton.cdiv(seg_len, block_m) * max(shape["segments"], 1) * shape["slices"]
    k_iters = triton.cdiv(shape["k"], block_k)
    split_k = 1
    # Double split-K while the grid is under ~2 waves and each split keeps >= 4 K steps.
    while base * split_k < 2 * shape["sms"] and k_iters // (split_k * 2) >= 4 and split_k < 64:
        split_k *= 2
    return ShrinkConfig(block_m, block_r, block_k, split_k, num_warps)


# sm_90: the tiles the kernel was tuned with (H100 / H200); elsewhere the same within the
# generic shared-memory budget (they differ only past rank 256)
SHRINK_CONFIGS: LaunchTable[ShrinkConfig] = LaunchTable(
    "lora_shrink",
    {
        "sm90": (Rule(_tiles),),
        GENERIC: (Rule(lambda shape: _tiles(shape, GENERIC_SMEM_BYTES)),),
    },
)


def shrink_config(
    max_seg_len: int,
    num_segments: int,
    num_slices: int,
    in_features: int,
    rank: int,
    device: torch.device | str | None = None,
) -> ShrinkConfig:
    """The launch for segments of up to ``max_seg_len`` tokens over ``in_features`` at
    ``rank`` on ``device`` (None: the generic rows); ``SHRINK_CONFIGS``."""
    sms = device_sms(torch.device(device)) if device is not None else 132
    return SHRINK_CONFIGS.pick(
        device, tokens=max_seg_len, segments=num_segments, slices=num_slices, k=in_features,
        rank=rank, sms=sms,
    )  # fmt: skip


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    ids_ptr,
    seg_slots_ptr,
    seg_starts_ptr,
    seg_lens_ptr,
    seg_ranks_ptr,
    K,
    R,
    stride_xm,
    stride_xk,
    stride_as,
    stride_al,
    stride_ar,
    stride_ak,
    stride_os,
    stride_om,
    stride_or,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    pid_sk = tl.program_id(2)
    s = pid_sk // SPLIT_K
    pid_k = pid_sk % SPLIT_K

    seg_len = tl.load(seg_lens_ptr + g)
    m0 = pid_m * BLOCK_M
    if m0 >= seg_len:
        return
    start = tl.load(seg_starts_ptr + g)
    slot = tl.load(seg_slots_ptr + g).to(tl.int64)
    rank = tl.minimum(tl.load(seg_ranks_ptr + g), R)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # (BLOCK_M,)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)

    # x tile (BLOCK_M, BLOCK_K); A^T tile (BLOCK_K, BLOCK_R)
    x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_base = a_ptr + s.to(tl.int64) * stride_as + slot * stride_al
    a_ptrs = a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    step = BLOCK_K * SPLIT_K
    # tl.full, not tl.zeros (a @jit helper): see the module doc
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, step):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + tl.arange(0, BLOCK_K)) < K
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(xt, at.to(xt.dtype), input_precision=FP32_PRECISION)
        x_ptrs += step * stride_xk
        a_ptrs += step * stride_ak

    o_ptrs = out_ptr + s.to(tl.int64) * stride_os + tok[:, None] * stride_om
    o_ptrs += offs_r[None, :] * stride_or
    o_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")


def shrink_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    mapping: LoRAMapping,
    out: torch.Tensor,
    *,
    config: ShrinkConfig | None = None,
    fp32_precision: str = "ieee",
) -> None:
    """Triton ``lora_shrink``; see ``reference.shrink_torch`` for the semantics.

    With ``config.split_k > 1`` the whole of ``out`` is zeroed first (one extra memset).
    """
    num_slices, _, max_rank, in_features = lora_a.shape
    num_segments = mapping.num_segments
    if num_segments == 0 or mapping.max_seg_len == 0:
        return
    if config is None:
        config = shrink_config(
            mapping.max_seg_len, num_segments, num_slices, in_features, max_rank, x.device
        )
    if config.block_r < max_rank:
        raise ValueError(f"config.block_r={config.block_r} < max rank {max_rank} of lora_a")
    if config.split_k > 1:
        out.zero_()
    grid = (
        triton.cdiv(mapping.max_seg_len, config.block_m),
        num_segments,
        num_slices * config.split_k,
    )
    _shrink_kernel[grid](
        x,
        lora_a,
        out,
        mapping.sorted_token_ids,
        mapping.seg_slots,
        mapping.seg_starts,
        mapping.seg_lens,
        mapping.seg_ranks,
        in_features,
        max_rank,
        x.stride(0),
        x.stride(1),
        *lora_a.stride(),
        *out.stride(),
        BLOCK_M=config.block_m,
        BLOCK_R=config.block_r,
        BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        EVEN_K=in_features % config.block_k == 0,
        FP32_PRECISION=fp32_precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
