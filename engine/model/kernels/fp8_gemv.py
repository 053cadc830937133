"""Triton: the CUDA-core fp8 GEMV of 1-4 tokens (``fp8_aug_linear`` runs it up to
``GEMV_MAX_TOKENS``; ``fp8_linear.py`` has the operands and the output).

At one token the tensor-core kernel streams fp8 at ~2.1 TB/s, bound by the latency of load
-> convert -> dot per tile, and a 16-row dot is mostly padding there. The GEMV has no dot:
each program owns ``block_n`` weight rows, loads (block_n, block_k) fp8 tiles with vector
loads, converts them to float32 in registers and multiplies them by the token's x slice,
accumulating in float32 per (row, token); the per-channel scale and bias are applied once at
the end. Same output, same launch shape otherwise: A rows in programs past the base rows
(bf16, no scale), split-K through the same workspace, counters and split-order reduction
(``_store_tile``), one launch, nothing that depends on more than ``T``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.fp8_splitk import _COUNTERS, _store_tile, prepare_fp8_linear
from loraplex.engine.model.kernels.launch_table import GENERIC, LaunchTable, Rule, device_sms

__all__ = [
    "FP8_GEMV_CONFIGS",
    "GEMV_CONFIGS",
    "GEMV_MAX_TOKENS",
    "GEMV_TOKENS",
    "Fp8GemvConfig",
    "fp8_gemv_config",
]


GEMV_MAX_TOKENS = 2  # fp8_aug_linear runs the CUDA-core GEMV up to this many tokens
GEMV_TOKENS = 4  # the most tokens the GEMV kernel takes (one accumulator set per token)


@dataclass(frozen=True)
class Fp8GemvConfig:
    """Launch of the CUDA-core GEMV (``_fp8_gemv_kernel``): no tensor cores, so no token tile;
    each program owns ``block_n`` weight rows over K / ``split_k`` columns, ``block_k`` per
    step (block_n x block_k fp8 bytes loaded per step by the program's threads)."""

    block_n: int = 16  # weight rows per program
    block_k: int = 256  # K columns per step
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1  # > 1: tl.range pipelines the step's loads through shared memory
    unroll: int = 1  # K steps unrolled by tl.range
    early_sum: bool = True  # sum each step's products per row (see _gemv_dot)


# (N, K, tokens) -> GEMV config, the fastest of ``benchmarks/fp8_gemm.py --gemv-only`` on sm_90
# (Llama-3-8B projections, 8 slots of rank 16, one token); shapes it lacks use the heuristic of
# fp8_gemv_config.
GEMV_CONFIGS: dict[tuple[int, int, int], Fp8GemvConfig] = {
    (6144, 4096, 1): Fp8GemvConfig(16, 256, 2, 4, 1, 1, False),
    (4096, 4096, 1): Fp8GemvConfig(8, 512, 1, 4, 1, 2, False),
    (28672, 4096, 1): Fp8GemvConfig(16, 256, 1, 8, 1, 1, True),
    (4096, 14336, 1): Fp8GemvConfig(16, 256, 4, 8, 1, 1, True),
}


def _heuristic(shape: Mapping[str, int], programs: int) -> Fp8GemvConfig:
    """Not measured yet: 16 rows x 256 columns per step, 4 warps, each step summed per row. A
    GEMV is bound by the weight bytes in flight per SM, and registers bound those: compiled for
    sm_90, this config takes 40 registers at one token (64-71 at two), so ~12 programs fit on
    an SM, each with 4 KB of fp8 loads per step; per-column accumulators instead take 70 (one
    float32 per weight of the step). A step wider than 256 columns (32 lanes x 8) spans warps,
    and its per-row sum goes through shared memory. Then K is split by powers of 2 while the
    grid stays within ``programs`` and each split keeps >= 4 steps: a 4096-wide output has
    only 256 row blocks, under 2 per SM of an H100."""
    n, k, group, e = shape["n"], shape["k"], shape["group"], shape["e"]
    bk = 256
    while bk > 32 and group != k and group % bk:
        bk //= 2
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    bn = 16
    tiles = triton.cdiv(n, bn) + triton.cdiv(e, bn)
    split = 1
    while (
        tiles * split * 2 <= programs and k % (2 * split * bk) == 0 and k // (2 * split) >= 4 * bk
    ):
        split *= 2
    return Fp8GemvConfig(bn, bk, split, num_warps=4)


def _tuned(cfg: Fp8GemvConfig) -> Callable[[Mapping[str, int]], Fp8GemvConfig | None]:
    """A measured row: taken where its K step divides the weight's scale groups."""
    return lambda s: cfg if s["group"] == s["k"] or s["group"] % cfg.block_k == 0 else None


# sm_90 (H100 / H200): the measured shapes, then the heuristic for ~8 programs on each of 132
# SMs. Elsewhere the heuristic for the device's SMs: no pipelined loads (one stage), a few KB
# of shared memory at most, so it runs on any fp8-capable GPU.
FP8_GEMV_CONFIGS = LaunchTable(
    "fp8_gemv",
    {
        "sm90": (
            *(Rule(_tuned(c), n=n, k=k, tokens=t) for (n, k, t), c in GEMV_CONFIGS.items()),
            Rule(lambda s: _heuristic(s, 1056)),
        ),
        GENERIC: (Rule(lambda s: _heuristic(s, 8 * s["sms"])),),
    },
)


def fp8_gemv_config(
    num_tokens: int,
    n: int,
    k: int,
    group: int,
    e: int = 0,
    device: torch.device | str | None = None,
) -> Fp8GemvConfig:
    """The GEMV launch for ``num_tokens`` (<= GEMV_TOKENS) rows against an (n, k) fp8 weight
    (+ ``e`` A rows) whose scale groups span ``group`` columns of K, on ``device`` (None: the
    generic rule); ``FP8_GEMV_CONFIGS``."""
    sms = device_sms(torch.device(device)) if device is not None else 132
    return FP8_GEMV_CONFIGS.pick(device, tokens=num_tokens, n=n, k=k, group=group, e=e, sms=sms)


@triton.jit
def _gemv_dot(acc, w, x_ptrs, kk, K, EVEN_K: tl.constexpr, ACC_K: tl.constexpr):
    """acc + w (BLOCK_N, BLOCK_K) float32 times one token's x[kk] broadcast over the rows.

    ACC_K = BLOCK_K: the products are kept per column and summed once after the K loop (no
    shuffles in the loop, but one float32 register per weight of the step). ACC_K = 1: each
    step's products are summed per row at once (a warp shuffle tree per row and step, but a
    (BLOCK_N, 1) accumulator: registers, hence programs per SM and bytes in flight, go to the
    loads). ``x_ptrs`` is (BLOCK_N, BLOCK_K), the same x row on every weight row, so x's load
    takes the weight tile's register layout: a (BLOCK_K,) load broadcast would take its own,
    and each step would pay a conversion through shared memory and its barriers. The
    compiler folds the repeated loads of a thread (they are L1 hits anyway)."""
    if EVEN_K:
        xk = tl.load(x_ptrs)
    else:
        xk = tl.load(x_ptrs, mask=(kk < K)[None, :], other=0.0)
    prod = w * xk.to(tl.float32)
    if ACC_K == 1:
        prod = tl.sum(prod, axis=1, keep_dims=True)
    return acc + prod


@triton.jit
def _gemv_load(w_rows, kt, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile of K step ``kt``, as stored. VEC columns per
    thread-load, as many as one 16-byte load of x holds: the weight tile and the x tile then
    take one register layout (fp8 alone would take 16, and x's tile would need converting)."""
    kk = kt * BLOCK_K + tl.arange(0, BLOCK_K)  # a multiple of BLOCK_K: aligned vector loads
    kw = tl.max_contiguous(tl.multiple_of(kk, VEC), VEC)
    if EVEN_K:
        return tl.load(w_rows + kw[None, :])
    return tl.load(w_rows + kw[None, :], mask=(kk < K)[None, :], other=0.0)


@triton.jit
def _gemv_partial(x_ptr, w_ptr, ws_ptr, rows, kt_lo, kt_hi, K, stride_xt, stride_wn, stride_sn,
                  IS_BASE: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
                  NUM_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ACC_K: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr,
                  NUM_STAGES: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
    """Per token t < NUM_T, a (BLOCK_N, ACC_K) float32 accumulator of x[t, k] * W[rows, k]
    over the K steps [kt_lo, kt_hi). ``rows`` are in range (the caller clamps them), so the
    weight loads carry no row mask and, with EVEN_K, no mask at all: full-width vector loads.
    fp8 rows are converted to float32 in registers (group scales applied per K step, one
    multiply per weight shared by the tokens); A rows are read as stored."""
    acc0 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    w_rows = w_ptr + rows[:, None] * stride_wn
    x_rows = x_ptr + (rows * 0)[:, None]  # (BLOCK_N, 1): x broadcast over the rows
    for kt in tl.range(kt_lo, kt_hi, num_stages=NUM_STAGES, loop_unroll_factor=UNROLL):
        w = _gemv_load(w_rows, kt, K, BLOCK_K, EVEN_K, VEC).to(tl.float32)
        if IS_BASE and not PER_CHANNEL:
            s = tl.load(ws_ptr + rows * stride_sn + (kt * BLOCK_K) // GROUP)
            w = w * s[:, None]
        kk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        acc0 = _gemv_dot(acc0, w, x_rows + kk[None, :], kk, K, EVEN_K, ACC_K)
        if NUM_T > 1:
            acc1 = _gemv_dot(acc1, w, x_rows + stride_xt + kk[None, :], kk, K, EVEN_K, ACC_K)
        if NUM_T > 2:
            acc2 = _gemv_dot(acc2, w, x_rows + 2 * stride_xt + kk[None, :], kk, K, EVEN_K, ACC_K)
        if NUM_T > 3:
            acc3 = _gemv_dot(acc3, w, x_rows + 3 * stride_xt + kk[None, :], kk, K, EVEN_K, ACC_K)
    return acc0, acc1, acc2, acc3


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, wq_ptr, ws_ptr, a_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    N, E, K,
    stride_xt, stride_wn, stride_sn, stride_an, stride_yt,
    NUM_T: tl.constexpr,  # tokens (1..GEMV_TOKENS): one compiled kernel per count
    GROUP: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_T: tl.constexpr,  # next power of 2 of NUM_T (the epilogue tile's narrow side)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ACC_K: tl.constexpr,  # BLOCK_K: per-column accumulators; 1: summed per step (_gemv_dot)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask on any load
    VEC: tl.constexpr,  # x elements in 16 bytes: weights per thread-load
    NUM_STAGES: tl.constexpr,
    UNROLL: tl.constexpr,  # K steps unrolled: more loads in flight per thread
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    base_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    kt_lo = pid_k * (k_tiles // SPLIT_K)  # NOTE: the host checks K % (SPLIT_K * BLOCK_K) == 0
    kt_hi = k_tiles if SPLIT_K == 1 else kt_lo + k_tiles // SPLIT_K
    if pid_n < base_tiles:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc0, acc1, acc2, acc3 = _gemv_partial(
            x_ptr, wq_ptr, ws_ptr, tl.minimum(cols, N - 1), kt_lo, kt_hi, K,
            stride_xt, stride_wn, stride_sn, True, GROUP, PER_CHANNEL,
            NUM_T, BLOCK_N, BLOCK_K, ACC_K, EVEN_K, VEC, NUM_STAGES, UNROLL)  # fmt: skip
        out_cols = cols
    else:
        cols = (pid_n - base_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < E
        acc0, acc1, acc2, acc3 = _gemv_partial(
            x_ptr, a_ptr, ws_ptr, tl.minimum(cols, E - 1), kt_lo, kt_hi, K,
            stride_xt, stride_an, stride_sn, False, GROUP, PER_CHANNEL,
            NUM_T, BLOCK_N, BLOCK_K, ACC_K, EVEN_K, VEC, NUM_STAGES, UNROLL)  # fmt: skip
        out_cols = N + cols
    # the per-token sums as one (BLOCK_N, BLOCK_T) tile for the shared epilogue
    toks = tl.arange(0, BLOCK_T)
    acc = tl.where(toks[None, :] == 0, tl.sum(acc0, axis=1)[:, None], 0.0)
    if NUM_T > 1:
        acc = tl.where(toks[None, :] == 1, tl.sum(acc1, axis=1)[:, None], acc)
    if NUM_T > 2:
        acc = tl.where(toks[None, :] == 2, tl.sum(acc2, axis=1)[:, None], acc)
    if NUM_T > 3:
        acc = tl.where(toks[None, :] == 3, tl.sum(acc3, axis=1)[:, None], acc)
    _store_tile(acc, y_ptr, part_ptr, count_ptr, ws_ptr, bias_ptr, toks, toks < NUM_T, cols,
                col_ok, out_cols, pid_n < base_tiles, pid_n, pid_k, NUM_T, N + E,
                stride_yt, stride_sn, SPLIT_K, PER_CHANNEL, HAS_BIAS)  # fmt: skip


def _launch_gemv(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    group: int,
    cfg: Fp8GemvConfig,
) -> None:
    """One launch of ``_fp8_gemv_kernel`` into ``out`` (shapes checked by the caller); the
    split-K workspace and counters are the tensor-core kernel's."""
    t, k = x.shape
    n = weight_fp8.shape[0]
    e = a.shape[0] if a is not None else 0
    tiles = triton.cdiv(n, cfg.block_n) + triton.cdiv(e, cfg.block_n)
    part = counters = x  # unused without split-K
    if cfg.split_k > 1:
        if tiles > _COUNTERS:
            raise ValueError(f"{tiles} output tiles exceed the split-K counters")
        counters = prepare_fp8_linear(x.device)
        part = torch.empty(cfg.split_k, t, n + e, dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(tiles, cfg.split_k)](
        x, weight_fp8, weight_scale,
        a if a is not None else x, bias if bias is not None else x, out, part, counters,
        n, e, k,
        x.stride(0), weight_fp8.stride(0), weight_scale.stride(0),
        a.stride(0) if a is not None else 0, out.stride(0),
        NUM_T=t, GROUP=group, PER_CHANNEL=group == k, HAS_BIAS=bias is not None,
        SPLIT_K=cfg.split_k, BLOCK_T=triton.next_power_of_2(t), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, ACC_K=1 if cfg.early_sum else cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, VEC=16 // x.element_size(), NUM_STAGES=cfg.num_stages,
        UNROLL=cfg.unroll, num_warps=cfg.num_warps,
    )  # fmt: skip
