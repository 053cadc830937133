"""Projection GEMMs of the fused GPU path, with the BLAS backend picked per shape by measurement.

For the skinny GEMMs of decode (T = 1..256 rows against 30 MB - 1 GB weights) cuBLAS and
cuBLASLt pick different kernels, and neither wins at every shape (at T = 64 on sm_90 cuBLASLt
read the gate_up / down weights 7-12 % faster, cuBLAS was faster for down at T = 128;
``benchmarks/base_configs.py``). ``tune`` times both on the real weights for one batch size
and remembers the faster per (T, N, K); ``linear`` runs ``F.linear`` under that choice, so a
CUDA graph captured afterwards records the chosen kernel. Shapes never tuned (prefill, CPU) use
torch's default.

A third candidate up to ``TRITON_MAX_TOKENS`` rows: the split-K tensor-core GEMM of
``kernels/fp8_linear.py`` fed the bf16 / fp16 weight itself with unit scales (its fp8
conversion is then a no-op), over a few tile / split configurations (``triton_configs``): at
decode sizes cuBLAS reads the small projections (qkv, o) at 64-73 % of the copy bandwidth
(BENCHMARKS.md, "Decode against the bandwidth floor"), and a split-K grid fills the SMs where
32-48 output tiles do not. It is picked only where it measured faster. Its split-K counters
are shared per device (``fp8_splitk.py``): the forward's one stream runs it.

Each candidate is timed with its weight coming from HBM, as in a decode step, where the GEMM
before it streamed other weights through the L2: every call follows a read of twice the L2,
and the reads alone are timed apart and subtracted. Back to back, a weight that fits the L2
(the o projection with its A rows, 34-38 MB against a 50 MB L2) would be timed from
there after the first call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from loraplex.engine.model.kernels.fp8_linear import Fp8LinearConfig

__all__ = ["BACKENDS", "TRITON_MAX_TOKENS", "linear", "tune", "choices", "triton_configs"]

BACKENDS = ("cublas", "cublaslt")  # torch's BLAS preferences; "triton" is the third choice
TRITON_MAX_TOKENS = 64
_choice: dict[tuple[int, int, int], str] = {}
_triton_cfg: dict[tuple[int, int, int], Fp8LinearConfig] = {}
_unit_scales: dict[tuple[torch.device, int], torch.Tensor] = {}
_lock = threading.Lock()


def choices() -> dict[tuple[int, int, int], str]:
    """(T, N, K) -> backend picked by ``tune`` so far."""
    return dict(_choice)


def triton_configs(
    num_tokens: int, n: int, k: int, device: torch.device | None = None
) -> list[Fp8LinearConfig]:
    """The split-K GEMM's candidates for (num_tokens, n, k): the kernel's own config on
    ``device`` and 64-row tiles over K tiles of 128 / 256 split 1-8 ways (each split keeping
    >= 2 K tiles). ``tune`` times them on the device and skips those it cannot launch."""
    import triton

    from loraplex.engine.model.kernels.fp8_linear import Fp8LinearConfig, fp8_linear_config

    bm = max(16, min(64, triton.next_power_of_2(max(num_tokens, 1))))
    out = [fp8_linear_config(num_tokens, n, k, k, device)]
    for bk in (128, 256):
        for split in (1, 2, 4, 8):
            if k % (split * bk) == 0 and k // split >= 2 * bk:
                cfg = Fp8LinearConfig(bm, 64, bk, split_k=split, num_warps=4, num_stages=4)
                if cfg not in out:
                    out.append(cfg)
    return out


def triton_linear(
    x: torch.Tensor, w: torch.Tensor, cfg: Fp8LinearConfig, b: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T (+ b)`` by the split-K GEMM: ``w`` as the kernel's weight with unit scales;
    float32 accumulation, the bias added before the one rounding (as cuBLAS's epilogue)."""
    from loraplex.engine.model.kernels.fp8_linear import fp8_aug_linear

    key = (w.device, w.shape[0])
    ones = _unit_scales.get(key)
    if ones is None:
        ones = _unit_scales[key] = torch.ones(w.shape[0], 1, dtype=torch.float32, device=w.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    return fp8_aug_linear(x, w, ones, None, b, config=cfg)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` under the backend ``tune`` picked for this shape, if any."""
    key = (x.shape[0], w.shape[0], w.shape[1])
    backend = _choice.get(key) if x.is_cuda else None
    if backend is None:
        return F.linear(x, w, b)
    if backend == "triton":
        return triton_linear(x, w, _triton_cfg[key], b)
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


def _triton_allowed(w: torch.Tensor, num_tokens: int) -> bool:
    return (
        w.dtype in (torch.bfloat16, torch.float16)
        and 0 < num_tokens <= TRITON_MAX_TOKENS
        and w.stride(1) == 1
    )


def _tune_triton(
    x: torch.Tensor, w: torch.Tensor, reps: int, flush: Callable[[], None] | None
) -> tuple[Fp8LinearConfig | None, float]:
    """The fastest of ``triton_configs`` (config, ms); (None, inf) if none runs. Also allocates
    the split-K counters (before any capture)."""
    from triton.runtime.errors import OutOfResources

    from loraplex.engine.model.kernels.fp8_linear import prepare_fp8_linear

    prepare_fp8_linear(w.device)
    best: tuple[Fp8LinearConfig | None, float] = (None, float("inf"))
    for cfg in triton_configs(x.shape[0], w.shape[0], w.shape[1], w.device):
        try:
            ms = _time_ms(lambda cfg=cfg: triton_linear(x, w, cfg), reps, flush)
        except (RuntimeError, ValueError, OutOfResources):  # a config this device cannot take
            continue
        if ms < best[1]:
            best = (cfg, ms)
    return best


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
        times: dict[str, float] = {}
        if _triton_allowed(w, num_tokens):
            cfg, t_ms = _tune_triton(x, w, reps, flush)
            if cfg is not None:
                _triton_cfg[key], times["triton"] = cfg, t_ms
        prev = torch.backends.cuda.preferred_blas_library()
        try:
            for backend in BACKENDS:
                torch.backends.cuda.preferred_blas_library(backend)
                try:
                    times[backend] = _time_ms(lambda x=x, w=w: F.linear(x, w), reps, flush)
                except RuntimeError:  # a backend this build or device lacks
                    continue
        finally:
            torch.backends.cuda.preferred_blas_library(prev)
        if times:
            _choice[key] = min(times, key=times.__getitem__)
