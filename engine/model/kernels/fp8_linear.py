"""Triton: the augmented projection GEMM of an fp8 base (``fp8_aug_linear``).

An fp8 base keeps each projection's weight as e4m3 values with float32 scales
(``quant.py``: ``weight_fp8`` (N, K), ``weight_scale`` (N, G), group = K // G) and the LoRA A
rows of every slot in the compute dtype (``LoRALinear.lora_a``, E = S * L * R rows). Decode is
bound by reading the weights, so the GEMM reads the fp8 bytes as they are and converts them to
the activations' dtype in registers (weight-only quantization, W8A16): half the bytes of a
bf16 weight, no activation quantization. One launch writes the same (T, N + E) output as the
bf16 augmented GEMM (``x @ [W; A].T``), so the fused epilogues read it unchanged:

    y[t, n]     = sum_k x[t, k] * weight_fp8[n, k] * weight_scale[n, k // group]  (+ bias[n])
    y[t, N + e] = sum_k x[t, k] * a[e, k]

Shape of the launch, for the skinny decode GEMMs (T = 1..64 rows against 16-120 MB):

- swapped operands: each program computes a (BLOCK_N weight rows, BLOCK_M tokens) tile as
  ``dot(W tile, x tile^T)``; the converted weight tile is the dot's first operand, which the
  tensor cores read from registers (no second trip through shared memory), and the token
  count only sets the dot's narrow side (16..64);
- split-K: ``SPLIT_K`` programs share one output tile, each over K / SPLIT_K columns, so the
  4096-wide outputs (64 column tiles) still fill 132 SMs with loads in flight. Each writes
  its float32 partial to a workspace and bumps the tile's counter; the last to arrive sums
  the partials in split order (deterministic, whatever the arrival order), scales, adds the
  bias, stores, and resets the counter to 0 for the next launch. Launches using the counters
  must not overlap: one stream runs the forward (``_counters`` says why);
- A rows: the programs past the base tiles read bf16 A rows (no conversion, no scale) in the
  same launch: the LoRA shrink costs no extra launch, only its bytes (E x K x 2).

Grid ``((cdiv(N, BLOCK_N) + cdiv(E, BLOCK_N)), SPLIT_K, cdiv(T, BLOCK_M))``. Nothing but
``T`` shapes the launch, so it can be captured in a CUDA graph. Launch configurations come
from ``CONFIGS`` (an H200 sweep of ``benchmarks/fp8_gemm.py``, BENCHMARKS.md) and
``fp8_linear_config`` for shapes it lacks. Semantics: ``fp8_aug_linear_torch`` (the twin:
de-quantize, then one float32 GEMM).

At 1-2 tokens (``GEMV_MAX_TOKENS``; the kernel takes up to ``GEMV_TOKENS``) the same call
runs a CUDA-core GEMV instead (``_fp8_gemv_kernel``): the tensor-core kernel streamed fp8 at
~2.1 TB/s at one token, the latency of load -> convert -> dot per tile (BENCHMARKS.md), and
a 16-row dot is mostly padding there. The GEMV has no dot: each program owns ``block_n``
weight rows, loads (block_n, block_k) fp8 tiles with vector loads, converts them to float32
in registers and multiplies them by the token's x slice, accumulating in float32 per (row,
token); the per-channel scale and bias are applied once at the end. Same output, same
launch shape otherwise: A rows in programs past the base rows (bf16, no scale), split-K
through the same workspace, counters and split-order reduction (``_store_tile``), one
launch, nothing that depends on more than ``T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "CONFIGS",
    "GEMV_CONFIGS",
    "GEMV_MAX_TOKENS",
    "GEMV_TOKENS",
    "Fp8GemvConfig",
    "Fp8LinearConfig",
    "fp8_gemv_config",
    "fp8_linear_config",
    "fp8_aug_linear",
    "fp8_aug_linear_torch",
    "prepare_fp8_linear",
]


@dataclass(frozen=True)
class Fp8LinearConfig:
    block_m: int = 16  # tokens per tile (the dot's narrow side)
    block_n: int = 64  # weight rows per tile
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


# (N, K, block_m) -> config: the best of the H200 sweep of benchmarks/fp8_gemm.py (2026-12-01,
# BENCHMARKS.md), summed over the bucket's token counts; N is the base rows (8 slots' A rows
# of rank 16 rode along). Llama-3-8B: qkv, o, gate_up, down.
CONFIGS: dict[tuple[int, int, int], Fp8LinearConfig] = {
    (6144, 4096, 16): Fp8LinearConfig(16, 64, 128, 2, 4, 4),
    (6144, 4096, 32): Fp8LinearConfig(32, 64, 128, 2, 4, 4),
    (6144, 4096, 64): Fp8LinearConfig(64, 64, 256, 1, 4, 3),
    (4096, 4096, 16): Fp8LinearConfig(16, 64, 128, 4, 4, 4),
    (4096, 4096, 32): Fp8LinearConfig(32, 64, 128, 4, 4, 4),
    (4096, 4096, 64): Fp8LinearConfig(64, 64, 256, 2, 4, 3),
    (28672, 4096, 16): Fp8LinearConfig(16, 64, 128, 1, 4, 4),
    (28672, 4096, 32): Fp8LinearConfig(32, 64, 128, 1, 4, 4),
    (28672, 4096, 64): Fp8LinearConfig(64, 64, 256, 1, 4, 3),
    (4096, 14336, 16): Fp8LinearConfig(16, 64, 128, 4, 4, 4),
    (4096, 14336, 32): Fp8LinearConfig(32, 64, 128, 4, 4, 4),
    (4096, 14336, 64): Fp8LinearConfig(64, 64, 256, 2, 4, 3),
}

_COUNTERS = 1 << 16  # tile counters per device for split-K (int32, zero between launches)
_counters: dict[torch.device, torch.Tensor] = {}


def _bucket(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64 if num_tokens <= 64 else 128


def fp8_linear_config(num_tokens: int, n: int, k: int, group: int) -> Fp8LinearConfig:
    """The launch configuration for ``num_tokens`` rows against an (n, k) fp8 weight whose
    scale groups span ``group`` columns of K (BLOCK_K must divide it when group < k)."""
    bm = _bucket(num_tokens)
    cfg = CONFIGS.get((n, k, bm))
    if cfg is not None and (group == k or group % cfg.block_k == 0):
        return cfg
    if bm == 128:  # prefill: a plain tiled GEMM, enough tiles without split-K
        bk = 64 if group == k or group % 64 == 0 else 32
        return Fp8LinearConfig(128, 128, bk, split_k=1, num_warps=8, num_stages=3)
    bk = 256 if bm <= 32 else 128
    while bk > 32 and group != k and group % bk:
        bk //= 2
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    bn = 64
    tiles = triton.cdiv(n, bn)
    split = 1
    # split K while the grid is under ~2 programs per SM and each split keeps >= 4 K tiles
    while tiles * split < 264 and k % (2 * split * bk) == 0 and k // (2 * split) >= 4 * bk:
        split *= 2
    return Fp8LinearConfig(bm, bn, bk, split_k=split, num_warps=4, num_stages=4)


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


# (N, K, tokens) -> GEMV config, the best of the H200 sweep of benchmarks/fp8_gemm.py
# (Llama-3-8B projections, 8 slots of rank 16, one token; BENCHMARKS.md); shapes it lacks use
# the heuristic of fp8_gemv_config.
GEMV_CONFIGS: dict[tuple[int, int, int], Fp8GemvConfig] = {
    (6144, 4096, 1): Fp8GemvConfig(16, 256, 2, 4, 1, 1, False),
    (4096, 4096, 1): Fp8GemvConfig(8, 512, 1, 4, 1, 2, False),
    (28672, 4096, 1): Fp8GemvConfig(16, 256, 1, 8, 1, 1, True),
    (4096, 14336, 1): Fp8GemvConfig(16, 256, 4, 8, 1, 1, True),
}


def fp8_gemv_config(num_tokens: int, n: int, k: int, group: int, e: int = 0) -> Fp8GemvConfig:
    """The GEMV launch for ``num_tokens`` (<= GEMV_TOKENS) rows against an (n, k) fp8 weight
    (+ ``e`` A rows) whose scale groups span ``group`` columns of K.

    Heuristic (not measured yet): 16 rows x 256 columns per step, 4 warps, each step summed
    per row. A GEMV is bound by the weight bytes in flight per SM, and registers bound
    those: compiled for sm_90, this config takes 40 registers at one token (64-71 at two),
    so ~12 programs fit on an SM, each with 4 KB of fp8 loads per step; per-column
    accumulators instead take 70 (one float32 per weight of the step). A step wider than
    256 columns (32 lanes x 8) spans warps, and its per-row sum goes through shared memory.
    Then K is split by
    powers of 2 while the grid stays within ~8 programs per SM (132 SMs) and each split
    keeps >= 4 steps: a 4096-wide output has only 256 row blocks, under 2 per SM."""
    cfg = GEMV_CONFIGS.get((n, k, num_tokens))
    if cfg is not None and (group == k or group % cfg.block_k == 0):
        return cfg
    bk = 256
    while bk > 32 and group != k and group % bk:
        bk //= 2
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    bn = 16
    tiles = triton.cdiv(n, bn) + triton.cdiv(e, bn)
    split = 1
    while tiles * split * 2 <= 1056 and k % (2 * split * bk) == 0 and k // (2 * split) >= 4 * bk:
        split *= 2
    return Fp8GemvConfig(bn, bk, split, num_warps=4)


@triton.jit
def _finish(acc, ws_ptr, bias_ptr, cols, col_ok, stride_sn,
            IS_BASE: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Per-channel scale and bias of a base tile (acc: (BLOCK_N, BLOCK_M) float32)."""
    if IS_BASE:
        if PER_CHANNEL:
            s = tl.load(ws_ptr + cols * stride_sn, mask=col_ok, other=0.0)
            acc = acc * s[:, None]
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
            acc += b.to(tl.float32)[:, None]
    return acc


@triton.jit
def _store_tile(acc, y_ptr, part_ptr, count_ptr, ws_ptr, bias_ptr, rows, row_ok, cols, col_ok,
                out_cols, is_base, tile, pid_k, T, width, stride_yt, stride_sn,
                SPLIT_K: tl.constexpr, PER_CHANNEL: tl.constexpr,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """Stores a (BLOCK_N output columns, tokens) float32 tile ``acc`` into y (T, width).

    Without split-K: scale and bias (base columns), store. With split-K: the partial goes to
    the workspace (SPLIT_K, T, width) and the tile's counter is bumped; the last program to
    arrive sums the partials in split order (the same bits whatever the arrival order),
    resets the counter to 0 for the next launch, then scales, adds the bias and stores."""
    mask = col_ok[:, None] & row_ok[None, :]
    y_ptrs = y_ptr + rows[None, :] * stride_yt + out_cols[:, None]
    if SPLIT_K == 1:
        if is_base:
            acc = _finish(acc, ws_ptr, bias_ptr, cols, col_ok, stride_sn,
                          True, PER_CHANNEL, HAS_BIAS)  # fmt: skip
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = part_ptr + rows[None, :] * width + out_cols[:, None]  # (SPLIT_K, T, width)
        tl.store(p_ptrs + pid_k * T * width, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:  # the last program of this tile reduces, in split order
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(p_ptrs + s * T * width, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
            if is_base:
                total = _finish(total, ws_ptr, bias_ptr, cols, col_ok, stride_sn,
                                True, PER_CHANNEL, HAS_BIAS)  # fmt: skip
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _partial(x_ptr, w_ptr, ws_ptr, rows, row_ok, cols, col_ok, k_lo, k_hi, K,
             stride_xt, stride_wn, stride_sn,
             IS_BASE: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             NUM_STAGES: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """(BLOCK_N, BLOCK_M) float32: W[cols, k_lo:k_hi] @ x[rows, k_lo:k_hi]^T; fp8 rows of a base
    tile converted in registers (group scales applied per K tile), A rows as stored."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        k_ok = kk < K
        xt = tl.load(
            x_ptr + rows[None, :] * stride_xt + kk[:, None],
            mask=row_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # (BLOCK_K, BLOCK_M)
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + kk[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        if IEEE:
            part = tl.dot(w.to(xt.dtype), xt, input_precision="ieee")
        else:
            part = tl.dot(w.to(xt.dtype), xt)
        if IS_BASE and not PER_CHANNEL:
            s = tl.load(ws_ptr + cols * stride_sn + k0 // GROUP, mask=col_ok, other=0.0)
            acc += part * s[:, None]
        else:
            acc += part
    return acc


@triton.jit(do_not_specialize=["T"])
def _fp8_aug_linear_kernel(
    x_ptr, wq_ptr, ws_ptr, a_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    T, N, E, K,
    stride_xt, stride_wn, stride_sn, stride_an, stride_yt,
    GROUP: tl.constexpr,  # K columns per scale
    PER_CHANNEL: tl.constexpr,  # one scale per output channel (G = 1)
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 dot (no tf32)
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    base_tiles = tl.cdiv(N, BLOCK_N)
    k_len = K // SPLIT_K  # NOTE: the host checks K % (SPLIT_K * BLOCK_K) == 0 when split
    k_lo = pid_k * k_len
    k_hi = K if SPLIT_K == 1 else k_lo + k_len
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # tokens
    row_ok = rows < T
    if pid_n < base_tiles:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = _partial(x_ptr, wq_ptr, ws_ptr, rows, row_ok, cols, col_ok, k_lo, k_hi, K,
                       stride_xt, stride_wn, stride_sn, True, GROUP, PER_CHANNEL,
                       BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, IEEE)  # fmt: skip
        out_cols = cols
    else:
        cols = (pid_n - base_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < E
        acc = _partial(x_ptr, a_ptr, ws_ptr, rows, row_ok, cols, col_ok, k_lo, k_hi, K,
                       stride_xt, stride_an, stride_sn, False, GROUP, PER_CHANNEL,
                       BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, IEEE)  # fmt: skip
        out_cols = N + cols
    _store_tile(acc, y_ptr, part_ptr, count_ptr, ws_ptr, bias_ptr, rows, row_ok, cols, col_ok,
                out_cols, pid_n < base_tiles, pid_m * tl.num_programs(0) + pid_n, pid_k, T, N + E,
                stride_yt, stride_sn, SPLIT_K, PER_CHANNEL, HAS_BIAS)  # fmt: skip


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


def _check(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> int:
    """The scale group (K columns per scale); raises ValueError on inconsistent shapes."""
    if x.dim() != 2 or weight_fp8.dim() != 2 or x.shape[1] != weight_fp8.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} against weight {tuple(weight_fp8.shape)}")
    n, k = weight_fp8.shape
    if weight_scale.dim() != 2 or weight_scale.shape[0] != n or k % weight_scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} for weight ({n}, {k})")
    if a is not None and (a.dim() != 2 or a.shape[1] != k or a.dtype != x.dtype):
        raise ValueError(f"A rows {tuple(a.shape)} {a.dtype}, want (E, {k}) {x.dtype}")
    if bias is not None and bias.shape[0] < n:
        raise ValueError(f"bias {tuple(bias.shape)} shorter than {n}")
    return k // weight_scale.shape[1]


def fp8_aug_linear_torch(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: (T, N + E) = x @ [de-quantized W; A].T (+ bias on the first N), computed in
    float32 and rounded once to x's dtype."""
    group = _check(x, weight_fp8, weight_scale, a, bias)
    w = weight_fp8.float() * weight_scale.float().repeat_interleave(group, dim=1)
    if a is not None:
        w = torch.cat([w, a.float()])
    y = x.float() @ w.t()
    if bias is not None:
        y[:, : weight_fp8.shape[0]] += bias[: weight_fp8.shape[0]].float()
    return y.to(x.dtype)


def prepare_fp8_linear(device: torch.device | str) -> torch.Tensor:
    """The split-K tile counters of ``device`` (allocated and zeroed once, outside any CUDA
    graph capture: the engine calls this before capturing)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("prepare_fp8_linear(device) must run before CUDA graph capture")
        counters = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


def fp8_aug_linear(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: Fp8LinearConfig | Fp8GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, N + E): ``x`` (T, K) against fp8 ``weight_fp8`` (N, K) with ``weight_scale``
    (N, G) float32, then against the A rows ``a`` (E, K) in x's dtype; ``bias`` (>= N) added
    to the first N columns. One Triton launch (see the module docstring): the CUDA-core GEMV
    up to GEMV_MAX_TOKENS tokens (or with an ``Fp8GemvConfig``), else the tensor-core GEMM."""
    group = _check(x, weight_fp8, weight_scale, a, bias)
    if x.stride(1) != 1 or weight_fp8.stride(1) != 1 or (a is not None and a.stride(1) != 1):
        raise ValueError("x, weight_fp8 and A rows must be contiguous along K")
    t, k = x.shape
    n = weight_fp8.shape[0]
    e = a.shape[0] if a is not None else 0
    if config is None and 0 < t <= GEMV_MAX_TOKENS:
        config = fp8_gemv_config(t, n, k, group, e)
    cfg = config or fp8_linear_config(t, n, k, group)
    if group != k and group % cfg.block_k:
        raise ValueError(f"scale group {group} is not a multiple of BLOCK_K {cfg.block_k}")
    if cfg.split_k > 1 and k % (cfg.split_k * cfg.block_k):
        raise ValueError(f"K {k} is not a multiple of SPLIT_K x BLOCK_K of {cfg}")
    if isinstance(cfg, Fp8GemvConfig) and t > GEMV_TOKENS:
        raise ValueError(f"the GEMV takes at most {GEMV_TOKENS} tokens, got {t}")
    if out is None:
        out = torch.empty(t, n + e, dtype=x.dtype, device=x.device)
    elif out.shape != (t, n + e) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, want ({t}, {n + e}) {x.dtype}")
    if t == 0:
        return out
    if isinstance(cfg, Fp8GemvConfig):
        _launch_gemv(x, weight_fp8, weight_scale, a, bias, out, group, cfg)
        return out
    tiles = triton.cdiv(n, cfg.block_n) + triton.cdiv(e, cfg.block_n)
    grid = (tiles, cfg.split_k, triton.cdiv(t, cfg.block_m))
    part = counters = x  # unused without split-K
    if cfg.split_k > 1:
        if tiles * grid[2] > _COUNTERS:
            raise ValueError(f"{tiles * grid[2]} output tiles exceed the split-K counters")
        counters = prepare_fp8_linear(x.device)
        part = torch.empty(cfg.split_k, t, n + e, dtype=torch.float32, device=x.device)
    _fp8_aug_linear_kernel[grid](
        x, weight_fp8, weight_scale,
        a if a is not None else x, bias if bias is not None else x, out, part, counters,
        t, n, e, k,
        x.stride(0), weight_fp8.stride(0), weight_scale.stride(0),
        a.stride(0) if a is not None else 0, out.stride(0),
        GROUP=group, PER_CHANNEL=group == k, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


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
