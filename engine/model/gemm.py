"""Projection GEMMs of the fused GPU path, with the BLAS backend picked per shape by measurement.

For the skinny GEMMs of decode (T = 1..256 rows against 30 MB - 1 GB weights) cuBLAS and
cuBLASLt pick different kernels, and neither wins at every shape (on the H200 at T = 64,
cuBLASLt reads the gate_up / down weights 7-12 % faster, cuBLAS is faster for down at T = 128;
BENCHMARKS.md). ``tune`` times both on the real weights for one batch size and remembers the
faster per (T, N, K); ``linear`` runs ``F.linear`` under that choice, so a CUDA graph captured
afterwards records the chosen kernel. Shapes never tuned (prefill, CPU) use torch's default.

Each candidate is timed with its weight coming from HBM, as in a decode step, where the GEMM
before it streamed other weights through the L2: every call follows a read of twice the L2,
and the reads alone are timed apart and subtracted. Back to back, a weight that fits the L2
(the o projection with its A rows, 34-38 MB against the H200's 50 MB) would be timed from
there after the first call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "linear", "tune", "choices"]

BACKENDS = ("cublas", "cublaslt")
_choice: dict[tuple[int, int, int], str] = {}
_lock = threading.Lock()


def choices() -> dict[tuple[int, int, int], str]:
    """(T, N, K) -> backend picked by ``tune`` so far."""
    return dict(_choice)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` under the backend ``tune`` picked for this shape, if any."""
    backend = _choice.get((x.shape[0], w.shape[0], w.shape[1])) if x.is_cuda else None
    if backend is None:
        return F.linear(x, w, b)
    with _lock:  # NOTE: the preference is process-wide; restore it at once
        prev = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(backend)
        try:
            return F.linear(x, w, b)
        finally:
            torch.backends.cuda.preferred_blas_library(prev)


def _l2_flusher(device: torch.device) -> Callable[[], None] | None:
    """A read of twice the L2 of ``device`` (evicts what the L2 holds); None where it cannot be
    had (no L2 size reported, no memory for the buffer): the timing is then warm."""
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    if l2 <= 0:
        return None
    try:
        buf = torch.ones(256, 2 * l2 // 512, dtype=torch.float16, device=device)
    except torch.OutOfMemoryError:
        return None
    sums = torch.empty(256, dtype=torch.float32, device=device)
    return lambda: torch.sum(buf, dim=1, dtype=torch.float32, out=sums)


def _graph_ms(body: Callable[[], None]) -> float:
    """ms per replay of a CUDA graph of ``body`` (warm-up outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up outside the capture (workspaces, heuristics)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        body()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 3


def _time_ms(fn: Callable[[], object], reps: int, flush: Callable[[], None] | None = None) -> float:
    """Time ``fn`` as the engine runs it: replays of a CUDA graph of ``reps`` calls (eager
    back-to-back calls rank the backends differently at some shapes); with ``flush``, each call
    after it, minus a graph of the flushes alone."""

    def calls() -> None:
        for _ in range(reps):
            if flush is not None:
                flush()
            fn()

    total = _graph_ms(calls)
    if flush is None:
        return total / reps

    def flushes() -> None:
        for _ in range(reps):
            flush()

    return (total - _graph_ms(flushes)) / reps


def tune(weights: list[torch.Tensor], num_tokens: int, reps: int = 10) -> None:
    """Pick the faster backend for ``x (num_tokens, K) @ w.T`` of every weight (CUDA only),
    each timed with its weight from HBM (module docstring)."""
    flushers: dict[torch.device, Callable[[], None] | None] = {}
    for w in weights:
        key = (num_tokens, w.shape[0], w.shape[1])
        if not w.is_cuda or key in _choice:
            continue
        x = torch.randn(num_tokens, w.shape[1], dtype=w.dtype, device=w.device)
        if w.device not in flushers:
            flushers[w.device] = _l2_flusher(w.device)
        flush = flushers[w.device]
        times = {}
        prev = torch.backends.cuda.preferred_blas_library()
        try:
            for backend in BACKENDS:
                torch.backends.cuda.preferred_blas_library(backend)
                times[backend] = _time_ms(lambda x=x, w=w: F.linear(x, w), reps, flush)
        except RuntimeError:  # a backend this build or device lacks
            continue
        finally:
            torch.backends.cuda.preferred_blas_library(prev)
        _choice[key] = min(times, key=times.__getitem__)
