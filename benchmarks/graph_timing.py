"""One launch timed as a decode step runs it: in a CUDA graph, with a warm or a cold L2.

Warm (``cold_l2=False``) is triton's ``do_bench_cudagraph``: the launch replayed back to back,
so whatever it reads that fits the L2 (an epilogue's 4-29 MB of LoRA B at rank 64, say) comes
from there after the first replay. In a decode step every epilogue follows a GEMM that streamed
40-243 MB of weights through the L2, so those bytes come from HBM. Cold (``cold_l2=True``)
captures ``n`` x (read of a buffer several times the L2, launch) and ``n`` x (the read alone)
in two graphs and returns the difference per launch: the launch's time with its inputs evicted
by clean lines, as after a GEMM (a write flush would leave dirty lines whose write-back competes
with the launch). BENCHMARKS.md "The epilogues at rank 64 tuned": warm sweeps saved 0.48 ms of
launches per step, the step 0.21 ms.

    from benchmarks.graph_timing import graph_us
    us = graph_us(fn)                  # warm, µs
    us = graph_us(fn, cold_l2=True)    # cold, µs
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch

__all__ = ["graph_us", "flush_bytes"]


def flush_bytes(device: torch.device | None = None) -> int:
    """Bytes read to evict the L2: 4 x its size, at least 256 MiB."""
    props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
    return max(4 * int(getattr(props, "L2_cache_size", 0)), 256 << 20)


@functools.cache
def _flusher(device_index: int) -> Callable[[], None]:
    rows = 1024
    cols = flush_bytes(torch.device("cuda", device_index)) // (2 * rows)
    buf = torch.ones(rows, cols, dtype=torch.float16, device=f"cuda:{device_index}")
    sums = torch.empty(rows, dtype=torch.float32, device=buf.device)
    return lambda: torch.sum(buf, dim=1, dtype=torch.float32, out=sums)


def _replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def _capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def graph_us(fn: Callable[[], object], *, cold_l2: bool = False, rep: int = 30, n: int = 20,
             repeats: int = 9) -> float:  # fmt: skip
    """µs per launch of ``fn`` (already compiled: call it once before). Warm: ``rep`` ms of
    replays (``do_bench_cudagraph``). Cold: median over ``repeats`` replays of the two graphs
    (alternating), each of ``n`` launches."""
    if not cold_l2:
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=rep) * 1e3
    flush = _flusher(torch.cuda.current_device())
    flush()
    fn()
    torch.cuda.synchronize()

    def both() -> None:
        for _ in range(n):
            flush()
            fn()

    def alone() -> None:
        for _ in range(n):
            flush()

    g_both, g_flush = _capture(both), _capture(alone)
    t_both, t_flush = [], []
    for _ in range(repeats):  # alternating, so clocks and neighbours drift alike
        t_both += _replay_ms(g_both, 1)
        t_flush += _replay_ms(g_flush, 1)
    per = (statistics.median(t_both) - statistics.median(t_flush)) / n
    return per * 1e3
