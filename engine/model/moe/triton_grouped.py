"""Triton: the grouped expert GEMM over pairs sorted by expert (``grouped_gemm.grouped_gemm``).

Grid ``(B, cdiv(N, BLOCK_N))`` for the B blocks of ``routing.ExpertBlocks``: program (b, n)
computes ``block_m`` sorted pairs of one expert against columns ``n`` of that expert's weight,
loading each (BLOCK_K, BLOCK_N) weight tile once for the block. Padding entries (pair == P) and
unused blocks (expert -1) load and store nothing. Semantics and roundings: the loop in
``grouped_gemm.py``; the twin ``grouped_gemm_torch``.

B, P, N and K shape the launch; P (the step's token count times k) is not specialised on
(``do_not_specialize``), so one compiled variant serves every step size of a config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.launch_table import GENERIC, LaunchTable, Rule
from loraplex.engine.model.moe.routing import ExpertBlocks

__all__ = ["GROUPED_CONFIGS", "GroupedConfig", "grouped_config", "grouped_gemm_triton"]


@dataclass(frozen=True)
class GroupedConfig:
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def smem_bytes(self, block_m: int, elem: int = 2) -> int:
        """Shared memory of the pipelined A (block_m x K tile) and W (K x N tile) loads."""
        return (block_m + self.block_n) * self.block_k * elem * self.num_stages


# The generic rows fit any supported GPU's shared memory (GENERIC_SMEM_BYTES): 16-bit weights
# 72 KB for blocks of 64 pairs, 60 KB for blocks of 16; float32 at most 64 KB
_GENERIC: tuple[Rule[GroupedConfig], ...] = (
    Rule(GroupedConfig(block_n=64, block_k=64, num_warps=4, num_stages=2), elem=(4, None)),
    Rule(GroupedConfig(block_n=128, block_k=64, num_warps=8, num_stages=3), block_m=(64, None)),
    Rule(GroupedConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)),
)
# sm_90 rows: benchmarks/moe_configs.py on an H100 (1a49833, CUDA graph replays, bf16), the
# Qwen3-30B-A3B expert shapes at 1 stream (8 pairs): gate_up (N 1536, K 2048) 24.3 -> 20.7 us,
# down (N 2048, K 768) 13.6 -> 12.1 us. At 64 streams the best config was within 1 % of the
# generic rule (263.9 / 265.8, 136.7 / 137.5 us): the generic rows stay there.
_SM90: tuple[Rule[GroupedConfig], ...] = (
    Rule(
        GroupedConfig(block_n=128, block_k=128, num_warps=4, num_stages=4),
        block_m=16,
        n=1536,
        k=2048,
        elem=2,
        pairs=(None, 64),
    ),  # fmt: skip
    Rule(
        GroupedConfig(block_n=32, block_k=256, num_warps=4, num_stages=2),
        block_m=16,
        n=2048,
        k=768,
        elem=2,
        pairs=(None, 64),
    ),  # fmt: skip
    *_GENERIC,
)
GROUPED_CONFIGS = LaunchTable("moe_grouped_gemm", {GENERIC: _GENERIC, "sm90": _SM90})


def grouped_config(
    block_m: int,
    n: int,
    k: int,
    elem: int = 2,
    device: torch.device | str | None = None,
    pairs: int = 0,
) -> GroupedConfig:
    """The launch for blocks of ``block_m`` pairs against (N, K) expert weights of ``elem``
    bytes an element, ``pairs`` routed pairs in all, on ``device`` (None: the generic rows);
    ``GROUPED_CONFIGS``."""
    return GROUPED_CONFIGS.pick(device, block_m=block_m, n=n, k=k, elem=elem, pairs=pairs)


@triton.jit(do_not_specialize=["P"])
def _grouped_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pairs_ptr,
    experts_ptr,
    scale_ptr,
    P,
    N,
    K,
    A_DIV: tl.constexpr,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    IEEE: tl.constexpr,
):
    blk = tl.program_id(0)
    expert = tl.load(experts_ptr + blk)
    if expert < 0:  # past the last used block
        return
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    live = pair < P
    row = (pair // A_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + row[:, None] * stride_am
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        a = tl.load(
            a_rows + kk[None, :] * stride_ak, mask=live[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_cols + kk[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0
        )
        if IEEE:  # float32 weights: no TF32 (the CPU oracle's precision)
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_SCALE:
        s = tl.load(scale_ptr + pair, mask=live, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty)
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, y, mask=live[:, None] & n_mask[None, :])


def grouped_gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    blocks: ExpertBlocks,
    out: torch.Tensor,
    *,
    a_div: int,
    scale: torch.Tensor | None = None,
    config: GroupedConfig | None = None,
) -> None:
    """Triton ``grouped_gemm``; shapes checked by the caller (``grouped_gemm.grouped_gemm``)."""
    p, n = out.shape
    if p == 0:
        return
    k = a.shape[1]
    cfg = config or grouped_config(blocks.block_m, n, k, w.element_size(), a.device, p)
    grid = (blocks.num_blocks, triton.cdiv(n, cfg.block_n))
    _grouped_kernel[grid](
        a,
        w,
        out,
        blocks.pairs,
        blocks.experts,
        scale if scale is not None else out,  # a pointer never read without HAS_SCALE
        p,
        n,
        k,
        a_div,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=blocks.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        HAS_SCALE=scale is not None,
        IEEE=w.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
