"""The split-K reduction the fp8 projection kernels share (``fp8_linear.py``'s tensor-core
GEMM and ``fp8_gemv.py``'s CUDA-core GEMV).

``SPLIT_K`` programs share one output tile, each over K / SPLIT_K columns. Each writes its
float32 partial to a workspace and bumps the tile's counter; the last to arrive sums the
partials in split order (deterministic, whatever the arrival order), applies the per-channel
scale and the bias, stores, and resets the counter to 0 for the next launch. The counters are
allocated once per device (``prepare_fp8_linear``, before any CUDA graph capture) and shared
by every launch, so launches using them must not overlap: one stream runs the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.workspace import per_device

__all__ = ["prepare_fp8_linear"]

_COUNTERS = 1 << 16  # tile counters per device for split-K (int32, zero between launches)
_counters: dict[torch.device, torch.Tensor] = {}


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


def prepare_fp8_linear(device: torch.device | str) -> torch.Tensor:
    """The split-K tile counters of ``device`` (allocated and zeroed once, outside any CUDA
    graph capture: the engine calls this before capturing)."""
    return per_device(
        _counters, device, lambda d: torch.zeros(_COUNTERS, dtype=torch.int32, device=d),
        "prepare_fp8_linear",
    )  # fmt: skip
