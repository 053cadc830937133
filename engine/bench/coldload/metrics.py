"""Per-request TTFT split, ITL with / without loads in flight, and the run summary.

TTFT split of one request (all parts add up to its TTFT):
  wait = admission - arrival; each load stage / slot wait / h2d interval of the request's
  adapter counts only where it overlaps the wait (clipped, never counted twice; none for a
  GPU hit);
  queue = wait - those parts; prefill = first token - admission.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from loraplex.engine.bench.coldload.collect import STAGES, LoadRecord, WriteRecord

__all__ = [
    "PARTS",
    "TIERS",
    "pct",
    "adapter_intervals",
    "inflight_intervals",
    "request_rows",
    "itl_samples",
    "split_stats",
    "ratio_interval",
    "backlog",
]

PARTS = ("queue", *STAGES, "slot_wait", "h2d", "prefill")
TIERS = ("gpu", "cpu", "cold", "base")


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) of ``xs`` (linear interpolation); None when empty."""
    return float(np.percentile(np.asarray(xs, dtype=float), q * 100)) if len(xs) else None


def adapter_intervals(
    loads: Iterable[LoadRecord], writes: Iterable[WriteRecord]
) -> dict[str, list[tuple[str, float, float]]]:
    """Per adapter name: (part, start, end) of its load stages, slot waits and h2d writes.

    A slot wait runs from the moment the adapter was last ready in the CPU tier (its load or
    its previous slot write ended) to the start of its next slot write.
    """
    out: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    ready: dict[str, list[float]] = defaultdict(list)
    for ld in loads:
        out[ld.name].extend(ld.intervals())
        if ld.ok:
            ready[ld.name].append(ld.t_end)
    for w in sorted(writes, key=lambda w: w.t_start):
        before = [t for t in ready[w.name] if t <= w.t_start]
        if before and max(before) < w.t_start:
            out[w.name].append(("slot_wait", max(before), w.t_start))
        out[w.name].append(("h2d", w.t_start, w.t_end))
        ready[w.name].append(w.t_end)
    return out


def _clipped(parts: list[tuple[str, float, float]], lo: float, hi: float) -> dict[str, float]:
    """Seconds of each part inside [lo, hi], overlaps removed (earlier intervals win)."""
    got: dict[str, float] = defaultdict(float)
    cursor = lo
    for kind, a, b in sorted(parts, key=lambda p: p[1]):
        a, b = max(a, cursor), min(b, hi)
        if b > a:
            got[kind] += b - a
            cursor = b
    return got


def request_rows(
    requests: Iterable[Any],
    intervals: dict[str, list[tuple[str, float, float]]],
    t0: float,
    errors: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One row per Request: tier, TTFT and its split, e2e, ITL figures (times relative to t0)."""
    rows = []
    errors = errors or {}
    for r in requests:
        times = r.token_times
        name = r.adapter.name if r.adapter is not None else None
        row: dict[str, Any] = {
            "request_id": r.request_id,
            "t_arrival": r.arrival - t0,
            "adapter": name,
            "tier": r.meta.get("tier", "base") if name else "base",
            "prompt_tokens": len(r.prompt_ids),
            "output_tokens": len(r.output_ids),
            "finish_reason": r.finish_reason,
            "preemptions": r.num_preemptions,
            "ttft_s": times[0] - r.arrival if times else None,
            "e2e_s": times[-1] - r.arrival if times else None,
            "error": errors.get(r.request_id),
        }
        row.update(dict.fromkeys(f"{p}_s" for p in PARTS))
        if times and r.scheduled_time is not None:
            wait = r.scheduled_time - r.arrival
            # a GPU hit waited on no load (a slot wait interval may span a time it was resident)
            parts = intervals.get(name, []) if name and row["tier"] != "gpu" else []
            got = _clipped(parts, r.arrival, r.scheduled_time)
            for p in PARTS[1:-1]:
                row[f"{p}_s"] = got.get(p, 0.0)
            row["queue_s"] = max(wait - sum(got.values()), 0.0)
            row["prefill_s"] = times[0] - r.scheduled_time
        gaps = np.diff(times) if len(times) > 1 else np.empty(0)
        row["itl_mean_s"] = float(gaps.mean()) if gaps.size else None
        row["itl_max_s"] = float(gaps.max()) if gaps.size else None
        rows.append(row)
    return rows


def inflight_intervals(
    loads: Iterable[LoadRecord], writes: Iterable[WriteRecord]
) -> list[tuple[float, float]]:
    """Merged time intervals with an adapter load (resolve..stage) or slot write in flight."""
    spans = sorted(
        [(ld.t_start, ld.t_end) for ld in loads] + [(w.t_start, w.t_end) for w in writes]
    )
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def itl_samples(
    requests: Iterable[Any], inflight: list[tuple[float, float]]
) -> list[tuple[float, float, bool]]:
    """(time of the token, gap since the previous token, a load in flight during the gap) for
    every token after a stream's first one (streams already running)."""
    starts = [a for a, _ in inflight]
    out = []
    for r in requests:
        times = r.token_times
        for prev, cur in zip(times, times[1:], strict=False):
            i = bisect.bisect_left(starts, cur) - 1  # last interval starting before cur
            loaded = i >= 0 and inflight[i][1] > prev
            out.append((cur, cur - prev, loaded))
    return out


def split_stats(with_load: Sequence[float], without: Sequence[float]) -> dict[str, Any]:
    """p50 / p99 of two samples and the with / without ratios (the stall figure)."""
    out: dict[str, Any] = {}
    for key, xs in (("with_load", with_load), ("without_load", without)):
        out[key] = {"n": len(xs), "p50_s": pct(xs, 0.5), "p99_s": pct(xs, 0.99)}
    for q in ("p50", "p99"):
        a, b = out["with_load"][f"{q}_s"], out["without_load"][f"{q}_s"]
        out[f"ratio_{q}"] = a / b if a is not None and b else None
    return out


def ratio_interval(
    cold: Sequence[tuple[float, float, bool]],
    warm: Sequence[tuple[float, float, bool]],
    *,
    q: float = 0.99,
    block_s: float = 2.0,
    draws: int = 400,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A 95 % interval of (q-quantile of the cold run's gaps) / (the same of the warm run's),
    by a paired block bootstrap over time: ``cold`` / ``warm`` are ``itl_samples`` rows with
    times relative to each run's start (the same arrival trace); the span is cut into blocks of
    ``block_s`` seconds (the gaps of one step are one event for every stream, so they are
    drawn together) and each draw takes the same block indices from both runs. None when a
    run has no gaps. An ITL p99 set by a few hundred prefill steps moves between runs of the
    same code; this says by how much."""
    if not cold or not warm:
        return None
    tc = np.asarray([t for t, _, _ in cold], dtype=float)
    tw = np.asarray([t for t, _, _ in warm], dtype=float)
    gc = np.asarray([g for _, g, _ in cold], dtype=float)
    gw = np.asarray([g for _, g, _ in warm], dtype=float)
    nb = max(1, int(np.ceil(max(tc.max(), tw.max()) / block_s)))
    bc = np.clip((tc // block_s).astype(int), 0, nb - 1)
    bw = np.clip((tw // block_s).astype(int), 0, nb - 1)
    cold_blocks = [gc[bc == i] for i in range(nb)]
    warm_blocks = [gw[bw == i] for i in range(nb)]
    rng = np.random.default_rng(seed)
    ratios = []
    for _ in range(draws):
        pick = rng.integers(0, nb, nb)
        c = np.concatenate([cold_blocks[i] for i in pick])
        w = np.concatenate([warm_blocks[i] for i in pick])
        if len(c) and len(w):
            ratios.append(np.quantile(c, q) / np.quantile(w, q))
    if not ratios:
        return None
    return float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))


def backlog(
    rows: Sequence[dict[str, Any]],
    loads: Sequence[LoadRecord],
    t0: float,
    span_s: float,
    *,
    parts: int = 3,
) -> dict[str, Any]:
    """Does the load path keep up with the arrivals? The arrival span is cut into ``parts``
    equal windows; for each: cold requests arrived, loads ended, the mean number of cold
    requests waiting on a load (arrived, not yet admitted), and the cold requests' TTFT p50.
    A load path that keeps up has the same waiting count and TTFT in the last window as in the
    first; a growing queue shows as both rising window by window.

    ``sustained``: every cold request finished, and the last window's waiting count is at most
    2 x the first's + 1 and its cold TTFT p50 at most 2 x the first's. ``loads_per_s``: ended
    loads per second of the span (the rate the run sustained when ``sustained`` holds).
    ``rows``: ``request_rows`` (times relative to ``t0``); ``loads``: monotonic times."""
    ends = [ld.t_end - t0 for ld in loads if ld.ok]
    cold = [r for r in rows if r["tier"] == "cold"]
    width = span_s / parts if span_s > 0 else 0.0
    windows = []
    for k in range(parts):
        lo, hi = k * width, (k + 1) * width
        mine = [r for r in cold if lo <= r["t_arrival"] < hi]
        # waiting: sampled every 10 ms of the window, a cold request counts from its arrival
        # to its admission (queue + load + slot); one never admitted counts to the end
        ts = np.arange(lo, hi, 0.01) if width > 0 else np.empty(0)
        waiting = np.zeros(len(ts))
        for r in cold:
            a = r["t_arrival"]
            w = (r["ttft_s"] - (r["prefill_s"] or 0.0)) if r["ttft_s"] is not None else np.inf
            waiting += (ts >= a) & (ts < a + w)
        ttft = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        windows.append({
            "t0_s": lo,
            "cold_arrived": len(mine),
            "loads_ended": sum(1 for t in ends if lo <= t < hi),
            "waiting_mean": float(waiting.mean()) if len(waiting) else None,
            "cold_ttft_p50_s": pct(ttft, 0.5),
        })  # fmt: skip
    first, last = windows[0], windows[-1]
    done = all(r["ttft_s"] is not None and r["error"] is None for r in cold)
    grow_ok = (
        first["waiting_mean"] is not None and last["waiting_mean"] <= 2 * first["waiting_mean"] + 1
    )
    ttft_ok = (
        first["cold_ttft_p50_s"] is None
        or last["cold_ttft_p50_s"] is None
        or last["cold_ttft_p50_s"] <= 2 * first["cold_ttft_p50_s"]
    )
    ended = sum(1 for t in ends if 0 <= t < span_s)
    return {
        "windows": windows,
        "loads_per_s": ended / span_s if span_s > 0 else None,
        "cold_per_s": len(cold) / span_s if span_s > 0 else None,
        "sustained": bool(cold) and done and grow_ok and ttft_ok,
    }
