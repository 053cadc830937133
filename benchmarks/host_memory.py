"""Host-memory costs that matter for cold loads, measured next to a running decode-like loop.

- cudaHostAlloc (``torch.empty(pin_memory=True)`` of a size the caching host allocator has not
  seen) and cudaFreeHost: how long they take and how long a GEMV loop on another thread stalls
  meanwhile (a driver lock, a device synchronization?).
- cudaHostRegister of a shared-memory segment (what a loader process writes into): its cost
  and the H2D bandwidth out of it, next to a plain pinned buffer.

    python -m benchmarks.host_memory
"""

from __future__ import annotations

import mmap
import threading
import time

import torch


def gemv_loop(stop: threading.Event, gaps: list[float]) -> None:
    """Back-to-back small GEMVs on the default stream, one sync each (a decode-like cadence)."""
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
    last = time.perf_counter()
    while not stop.is_set():
        for _ in range(20):
            x = (x @ w.T).clamp_(-1, 1)
        torch.cuda.current_stream().synchronize()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def with_loop(fn) -> tuple[float, float, float]:
    """(fn seconds, loop p50 gap ms, loop max gap ms while fn ran)."""
    stop, gaps = threading.Event(), []
    t = threading.Thread(target=gemv_loop, args=(stop, gaps))
    t.start()
    time.sleep(0.3)
    n0 = len(gaps)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    time.sleep(0.05)
    stop.set()
    t.join()
    quiet = sorted(gaps[5:n0])
    during = gaps[n0:]
    return dt, quiet[len(quiet) // 2] * 1e3, max(during) * 1e3


def h2d_gbps(src: torch.Tensor, reps: int = 10) -> float:
    dst = torch.empty(src.numel(), dtype=src.dtype, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        dst.copy_(src, non_blocking=True)
        s.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        s.synchronize()
    return src.numel() * src.element_size() * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    torch.cuda.init()
    rows = []
    for mb in (27, 84):
        n = (mb << 20) + 4096 * len(rows)  # a size the caching host allocator has not seen
        bufs: list[torch.Tensor] = []

        def alloc(n=n, bufs=bufs):
            bufs.append(torch.empty(n, dtype=torch.uint8, pin_memory=True))

        dt, p50, mx = with_loop(alloc)
        rows.append((f"pinned alloc {mb} MB (new size)", dt * 1e3, p50, mx))
        bufs.clear()

        empty = getattr(torch._C, "_host_emptyCache", None)  # cudaFreeHost of cached blocks
        if empty is not None:
            dt, p50, mx = with_loop(empty)
            rows.append((f"cudaFreeHost {mb} MB", dt * 1e3, p50, mx))
    size = 2 << 30
    mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.fill_(1)  # fault the pages in first
    ptr = host.data_ptr()
    cudart = torch.cuda.cudart()
    dt, p50, mx = with_loop(lambda: cudart.cudaHostRegister(ptr, size, 0))
    rows.append(("cudaHostRegister 2 GiB shared", dt * 1e3, p50, mx))
    print(f"{'what':36} {'ms':>8} {'loop p50':>9} {'loop max':>9}")
    for r in rows:
        print(f"{r[0]:36} {r[1]:8.2f} {r[2]:9.2f} {r[3]:9.2f}")
    for mb in (27, 84):
        n = mb << 20
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        print(
            f"H2D {mb} MB: pinned {h2d_gbps(pinned):.1f} GB/s, "
            f"registered shared {h2d_gbps(host[:n]):.1f} GB/s, is_pinned={host.is_pinned()}"
        )
    cudart.cudaHostUnregister(ptr)


if __name__ == "__main__":
    main()
