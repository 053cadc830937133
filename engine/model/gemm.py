"""Projection GEMMs of the fused GPU path, with the BLAS backend picked per shape by measurement.

For the skinny GEMMs of decode (T = 1..256 rows against 30 MB - 1 GB weights) cuBLAS and
cuBLASLt pick different kernels, and neither wins at every shape (on the H200 at T = 64,
cuBLASLt reads the gate_up / down weights 7-12 % faster, cuBLAS is faster for down at T = 128;
BENCHMARKS.md). ``tune`` times both on the real weights for one batch size and remembers the
faster per (T, N, K); ``linear`` runs ``F.linear`` under that choice, so a CUDA graph captured
afterwards records the chosen kernel. Shapes never tuned (prefill, CPU) use torch's default.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "linear", "tune", "choices"]

BACKENDS = ("cublas", "cublaslt")
_choice: dict[tuple[int, int, int], str] = {}
_lock = threading.Lock()


def choices() -> dict[tuple[int, int, int], str]:
    """(T, N, K) -> backend picked by ``tune`` so far."""
    return dict(_choice)


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, leave_sms: int = 0
) -> torch.Tensor:
    """``F.linear(x, w, b)`` under the backend ``tune`` picked for this shape, if any.

    ``leave_sms`` > 0 (CUDA): cuBLASLt, told to target that many SMs fewer than the device has
    (torch's SM carveout, an experimental hint cuBLASLt's heuristic takes into account), so
    that work launched beside it (fused.py's side form) finds SMs free; refused where this
    torch lacks the knob."""
    if leave_sms > 0 and x.is_cuda:
        setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
        if setter is None:
            raise RuntimeError("this torch has no SM carveout for cuBLASLt (leave_sms)")
        with _lock:  # NOTE: both settings are process-wide; restore them at once
            prev = torch.backends.cuda.preferred_blas_library()
            prev_sms = torch._C._get_sm_carveout_experimental()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            setter(leave_sms)
            try:
                return F.linear(x, w, b)
            finally:
                setter(prev_sms)
                torch.backends.cuda.preferred_blas_library(prev)
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


def _time_ms(fn, reps: int) -> float:
    """Time ``fn`` as the engine runs it: replays of a CUDA graph of ``reps`` calls (eager
    back-to-back calls rank the backends differently at some shapes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (workspaces, heuristics)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * reps)


def tune(weights: list[torch.Tensor], num_tokens: int, reps: int = 10) -> None:
    """Pick the faster backend for ``x (num_tokens, K) @ w.T`` of every weight (CUDA only)."""
    for w in weights:
        key = (num_tokens, w.shape[0], w.shape[1])
        if not w.is_cuda or key in _choice:
            continue
        x = torch.randn(num_tokens, w.shape[1], dtype=w.dtype, device=w.device)
        times = {}
        prev = torch.backends.cuda.preferred_blas_library()
        try:
            for backend in BACKENDS:
                torch.backends.cuda.preferred_blas_library(backend)
                times[backend] = _time_ms(lambda x=x, w=w: F.linear(x, w), reps)
        except RuntimeError:  # a backend this build or device lacks
            continue
        finally:
            torch.backends.cuda.preferred_blas_library(prev)
        _choice[key] = min(times, key=times.__getitem__)
