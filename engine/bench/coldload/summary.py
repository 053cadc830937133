"""The summary of one run: tiers and hit rates, TTFT (split), decode stall, loads, H2D."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from loraplex.engine.bench.coldload.collect import FETCH_STAGES, STAGES, LoadRecord, WriteRecord
from loraplex.engine.bench.coldload.metrics import PARTS, TIERS, backlog, pct, split_stats

if TYPE_CHECKING:
    from loraplex.engine.executor import StepRecord

__all__ = ["summarize", "yardstick"]


def _dist(xs: list[float]) -> dict[str, Any]:
    return {
        "n": len(xs),
        "mean_s": float(np.mean(xs)) if xs else None,
        "p50_s": pct(xs, 0.5),
        "p90_s": pct(xs, 0.9),
        "p99_s": pct(xs, 0.99),
    }


def _tiers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = Counter(r["tier"] for r in rows)
    adapter_reqs = sum(counts[t] for t in ("gpu", "cpu", "cold"))
    out: dict[str, Any] = {"counts": {t: counts.get(t, 0) for t in TIERS}}
    for t, key in (("gpu", "gpu_hit_rate"), ("cpu", "cpu_hit_rate"), ("cold", "miss_rate")):
        out[key] = counts.get(t, 0) / adapter_reqs if adapter_reqs else None
    return out


def _ttft(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if r["ttft_s"] is not None]
    out: dict[str, Any] = {"all": _dist([r["ttft_s"] for r in done])}
    for t in TIERS:
        mine = [r for r in done if r["tier"] == t]
        split = [r for r in mine if r["queue_s"] is not None]
        out[t] = _dist([r["ttft_s"] for r in mine])
        out[t]["split_mean_s"] = {
            p: float(np.mean([r[f"{p}_s"] for r in split])) if split else None for p in PARTS
        }
    return out


def _loads(loads: list[LoadRecord], folder_bytes: int) -> dict[str, Any]:
    ok = [ld for ld in loads if ld.ok]
    fresh = [ld for ld in ok if ld.fresh]
    stages = {}
    for s in STAGES:
        xs = [ld.stages[s] for ld in (fresh if s in FETCH_STAGES else ok)]
        stages[s] = {
            "mean_s": float(np.mean(xs)) if xs else None,
            "p50_s": pct(xs, 0.5),
            "p99_s": pct(xs, 0.99),
        }
    return {
        "count": len(loads),
        "ok": len(ok),
        "failed": len(loads) - len(ok),
        "fetched": len(fresh),
        "restaged": len(ok) - len(fresh),
        "bytes_fetched": folder_bytes * len(fresh),
        "total": _dist([ld.total_s for ld in ok]),
        "stages": stages,
    }


def _h2d(
    writes: list[WriteRecord], pinned_gbps: float | None, copy_gbps: float | None
) -> dict[str, Any]:
    rates = [w.gbps for w in writes if w.gbps is not None]
    secs = sum(w.h2d_s for w in writes)
    agg = sum(w.nbytes for w in writes) / secs / 1e9 if secs > 0 else None
    med = pct(rates, 0.5)
    return {
        "writes": len(writes),
        "bytes": sum(w.nbytes for w in writes),
        "event_gbps_p50": med,
        "event_gbps_aggregate": agg,
        "write_slot_gbps": copy_gbps,
        "pinned_gbps": pinned_gbps,
        "event_vs_pinned": med / pinned_gbps if med and pinned_gbps else None,
        "write_slot_vs_pinned": copy_gbps / pinned_gbps if copy_gbps and pinned_gbps else None,
    }


def _steps(step_log: list[StepRecord]) -> dict[str, Any]:
    """Decode-only steps of the step log, split by the engine's loading flag."""
    decode = [e for e in step_log if e.decode]
    return split_stats(
        [e.seconds for e in decode if e.loading], [e.seconds for e in decode if not e.loading]
    )


def _prefill_steps(step_log: list[StepRecord]) -> dict[str, Any]:
    """Steps that carry prefill tokens (what sets an ITL p99 when prompts are long): how
    many, their tokens and seconds, and seconds per thousand tokens. A cold run against the
    warm run of the same trace tells apart more prefill per step (admissions bunched behind
    loads) from the same prefill running slower (loads competing with the step)."""
    pre = [e for e in step_log if not e.decode]
    toks = [float(e.tokens) for e in pre]
    secs = [e.seconds for e in pre]
    per_k = [e.seconds / e.tokens * 1e3 for e in pre if e.tokens]
    return {
        "n": len(pre),
        "tokens_p50": pct(toks, 0.5),
        "tokens_p99": pct(toks, 0.99),
        "tokens_max": max(toks, default=None),
        "p50_s": pct(secs, 0.5),
        "p99_s": pct(secs, 0.99),
        "s_per_ktok_p50": pct(per_k, 0.5),
    }


def _consistency(
    rows: list[dict[str, Any]], loads: list[LoadRecord], stats: dict[str, int]
) -> dict[str, Any]:
    counts = Counter(r["tier"] for r in rows)
    cold_names = {r["adapter"] for r in rows if r["tier"] == "cold"}
    out = {
        "gpu_requests": counts.get("gpu", 0),
        "gpu_hits": stats.get("gpu_hits", 0),
        "cpu_requests": counts.get("cpu", 0),
        "cpu_hits": stats.get("cpu_hits", 0),
        "cold_requests": counts.get("cold", 0),
        "misses": stats.get("misses", 0),
        "loads": stats.get("loads", 0),
        "load_cancels": stats.get("load_cancels", 0),  # (no event: the requests went)
        "load_events": len(loads),
        "distinct_cold_adapters": len(cold_names),
    }
    out["ok"] = (
        out["gpu_requests"] == out["gpu_hits"]
        and out["cpu_requests"] == out["cpu_hits"]
        and out["cold_requests"] == out["misses"]
        and out["loads"] == out["load_events"] + out["load_cancels"]
        and out["distinct_cold_adapters"] <= out["loads"] <= max(out["cold_requests"], 0)
    )
    return out


def summarize(
    *,
    rows: list[dict[str, Any]],
    loads: list[LoadRecord],
    writes: list[WriteRecord],
    itl: list[tuple[float, float, bool]],
    step_log: list[StepRecord],
    stats: dict[str, int],
    folder_bytes: int,
    pinned_gbps: float | None,
    copy_gbps: float | None,
    measured_s: float,
    lag: list[float],
    t0: float = 0.0,
    span_s: float | None = None,
) -> dict[str, Any]:
    """Everything the text summary, the sweep table and the plots need of one run."""
    done = [r for r in rows if r["finish_reason"] in ("stop", "length")]
    itl_split = split_stats([d for _, d, w in itl if w], [d for _, d, w in itl if not w])
    gaps = [d for _, d, _ in itl]
    itl_split["all"] = {"n": len(gaps), "p50_s": pct(gaps, 0.5), "p99_s": pct(gaps, 0.99)}
    return {
        "requests": {
            "submitted": len(rows),
            "completed": len(done),
            "aborted": sum(r["finish_reason"] == "abort" for r in rows),
            "errors": sum(r["finish_reason"] == "error" or r["error"] is not None for r in rows),
        },
        "measured_s": measured_s,
        "throughput": {
            "requests_per_s": len(done) / measured_s if measured_s else None,
            "output_tokens_per_s": sum(r["output_tokens"] for r in rows) / measured_s
            if measured_s
            else None,
            "submit_lag_p99_s": pct(lag, 0.99),
        },
        "tiers": _tiers(rows),
        "engine": {"adapters": stats},
        "consistency": _consistency(rows, loads, stats),
        "ttft": _ttft(rows),
        "itl": itl_split,
        "decode_stall_ratio": itl_split["ratio_p99"],
        "decode_steps": _steps(step_log),
        "prefill_steps": _prefill_steps(step_log),
        "loads": _loads(loads, folder_bytes),
        "h2d": _h2d(writes, pinned_gbps, copy_gbps),
        "backlog": backlog(rows, loads, t0, span_s if span_s is not None else measured_s),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def yardstick(cold: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """The cold run against the warm run of the same trace (every adapter pre-staged in the CPU
    tier): what the cold loads themselves cost the running streams, with the traffic the same.

    ``ratio_p99``: ITL p99 over every gap of the cold run / the same of the warm run;
    ``with_load_ratio_p99``: the cold run's gaps with a load in flight / the warm run's all."""
    c_all, w_all = cold["itl"]["all"], warm["itl"]["all"]
    return {
        "warm_itl": w_all,
        "warm_misses": warm["tiers"]["counts"]["cold"],
        "warm_ttft": warm["ttft"]["all"],
        "warm_steps_p99_s": warm["decode_steps"]["without_load"]["p99_s"],
        "prefill_steps": {"cold": cold.get("prefill_steps"), "warm": warm.get("prefill_steps")},
        "cold_itl": c_all,
        "ratio_p50": _ratio(c_all["p50_s"], w_all["p50_s"]),
        "ratio_p99": _ratio(c_all["p99_s"], w_all["p99_s"]),
        "with_load_ratio_p99": _ratio(cold["itl"]["with_load"]["p99_s"], w_all["p99_s"]),
    }
