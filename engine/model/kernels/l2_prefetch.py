"""Triton: read a projection's LoRA B rows into the GPU's L2 ahead of their use (``l2_prefetch``).

A prefetch has no output: each program reads its chunk with evict-last loads and stores nothing
(the sum it keeps is stored only if it equals a value it cannot take, so the loads stay). Run on
a side stream beside the projection's GEMM (fused.py's ``LORAPLEX_LORA_SIDE=prefetch``), the
epilogue's expand then finds ``B`` in the L2 instead of HBM: the reads move to where the skinny
GEMM leaves bandwidth unused. ``lora_b`` (L, N, R) stored rank-major per slot, (L, R, N): the
step's ``rows`` rank rows of a slot are one contiguous run of ``rows * N`` elements; stored
column-major, (L, N, R) contiguous: the whole slot is read. Off CUDA
(but under the Triton interpreter) or in a step of torch twins it does nothing: it changes no value, so it has no twin to match.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["l2_prefetch", "l2_prefetch_tensor"]

BLOCK, ITERS = 2048, 4  # elements per load, loads per program


@triton.jit
def _prefetch_kernel(ptr, run, stride_l, sink, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = ptr + tl.program_id(0).to(tl.int64) * stride_l
    start = tl.program_id(1) * BLOCK * ITERS
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < run, other=0.0, eviction_policy="evict_last")
        acc += x.to(tl.float32)
    total = tl.reduce(acc, 0, tl.standard._sum_combine)
    if total == -1.2345e30:  # never: keeps the loads
        tl.store(sink, total)


def l2_prefetch(
    lora_b: torch.Tensor, rows: int | None, sink: torch.Tensor, *, triton_kernels: bool = True
) -> None:
    """Read rank rows ``0 .. rows`` (None: all) of every slot of ``lora_b`` into the L2.
    ``sink``: a float32 scalar buffer on the device, never written in practice. Runs on CUDA,
    or under the Triton interpreter (tests); ``triton_kernels`` False (the step's twins): not."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not triton_kernels or not (lora_b.is_cuda or interpreted):
        return
    num_slots, n, rank = lora_b.shape
    rows = rank if rows is None else min(rows, rank)
    if lora_b.stride(2) == n and lora_b.stride(1) == 1:  # rank-major: the rows' prefix
        run = rows * n
    elif lora_b.stride(2) == 1 and lora_b.stride(1) == rank:  # column-major (L, N, R): all of it
        run = n * rank
    else:
        raise ValueError(f"lora_b strides {lora_b.stride()}: want each slot's rows contiguous")
    _launch(lora_b, num_slots, run, lora_b.stride(0), sink)


def l2_prefetch_tensor(t: torch.Tensor, sink: torch.Tensor, *, triton_kernels: bool = True) -> None:
    """Read all of a contiguous tensor into the L2 (a projection's weight rows, say), on the
    terms of ``l2_prefetch``."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not triton_kernels or not (t.is_cuda or interpreted):
        return
    if not t.is_contiguous():
        raise ValueError("l2_prefetch_tensor: the tensor must be contiguous")
    _launch(t, 1, t.numel(), 0, sink)


def _launch(t: torch.Tensor, runs: int, run: int, stride: int, sink: torch.Tensor) -> None:
    if runs == 0 or run == 0:
        return
    grid = (runs, triton.cdiv(run, BLOCK * ITERS))
    _prefetch_kernel[grid](t, run, stride, sink, BLOCK=BLOCK, ITERS=ITERS, num_warps=8)
