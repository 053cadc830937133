"""Files of a run (result.json, requests.csv, loads.csv, slot_writes.csv) and the text summary."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from loraplex.engine.bench.coldload.collect import STAGES
from loraplex.engine.bench.coldload.run import PointResult

__all__ = ["write_point", "write_sweep", "point_line", "sweep_row"]


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf -> None, tuples -> lists, dataclasses (lengths) -> text."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if dataclasses.is_dataclass(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _load_rows(res: PointResult, t0: float) -> list[dict[str, Any]]:
    rows = []
    for ld in res.loads:
        row = {
            "adapter": ld.name,
            "digest": ld.digest[:12],
            "ok": ld.ok,
            "fresh": ld.fresh,
            "t_start": ld.t_start - t0,
            "t_end": ld.t_end - t0,
            "total_s": ld.total_s,
        }
        row.update({f"{s}_s": ld.stages[s] for s in STAGES})
        row.update(nbytes=ld.nbytes, error=ld.error)
        rows.append(row)
    return rows


def _write_rows(res: PointResult, t0: float) -> list[dict[str, Any]]:
    return [
        {
            "adapter": w.name,
            "slot": w.slot,
            "t_start": w.t_start - t0,
            "t_end": w.t_end - t0,
            "h2d_s": w.h2d_s,
            "nbytes": w.nbytes,
            "gbps": w.gbps,
        }
        for w in res.writes
    ]


def _csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in columns})


def write_point(res: PointResult, out: Path) -> list[Path]:
    """Write one run's files into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    loads, writes = _load_rows(res, res.start), _write_rows(res, res.start)
    doc = {
        "label": res.label,
        "sweep_values": res.values,
        "config": res.config.to_dict(),
        "engine": res.engine,
        "summary": res.summary,
        "requests": res.requests,
        "loads": loads,
        "slot_writes": writes,
    }
    paths = [out / "result.json", out / "requests.csv", out / "loads.csv", out / "slot_writes.csv"]
    paths[0].write_text(json.dumps(_clean(doc), indent=1))
    _csv(paths[1], res.requests, list(res.requests[0]) if res.requests else ["request_id"])
    _csv(paths[2], loads, list(loads[0]) if loads else ["adapter"])
    _csv(paths[3], writes, list(writes[0]) if writes else ["adapter"])
    return paths


def sweep_row(res: PointResult) -> dict[str, Any]:
    """One flat row of the sweep table."""
    s = res.summary
    tiers, ttft, h2d = s["tiers"], s["ttft"], s["h2d"]
    row: dict[str, Any] = {"label": res.label, **{k: _flat(v) for k, v in res.values.items()}}
    row.update(
        requests=s["requests"]["submitted"],
        completed=s["requests"]["completed"],
        gpu_hit_rate=tiers["gpu_hit_rate"],
        cpu_hit_rate=tiers["cpu_hit_rate"],
        miss_rate=tiers["miss_rate"],
        ttft_p50_s=ttft["all"]["p50_s"],
        ttft_p99_s=ttft["all"]["p99_s"],
        cold_ttft_p99_s=ttft["cold"]["p99_s"],
        itl_p99_load_s=s["itl"]["with_load"]["p99_s"],
        itl_p99_noload_s=s["itl"]["without_load"]["p99_s"],
        decode_stall_ratio=s["decode_stall_ratio"],
        step_stall_ratio=s["decode_steps"]["ratio_p99"],
        itl_p99_s=s["itl"]["all"]["p99_s"],
        warm_itl_p99_s=(s.get("yardstick") or {}).get("warm_itl", {}).get("p99_s"),
        cold_warm_ratio=(s.get("yardstick") or {}).get("ratio_p99"),
        cold_warm_ratio_lo=((s.get("yardstick") or {}).get("ratio_p99_interval") or (None,))[0],
        cold_warm_ratio_hi=((s.get("yardstick") or {}).get("ratio_p99_interval") or (None, None))[
            1
        ],
        loads=s["loads"]["count"],
        loads_per_s=(s.get("backlog") or {}).get("loads_per_s"),
        load_path_sustained=(s.get("backlog") or {}).get("sustained"),
        bytes_fetched=s["loads"]["bytes_fetched"],
        gpu_evictions=s["engine"]["adapters"].get("gpu_evictions"),
        cpu_evictions=s["engine"]["adapters"].get("cpu_evictions"),
        h2d_event_gbps=h2d["event_gbps_p50"],
        write_slot_gbps=h2d["write_slot_gbps"],
        pinned_gbps=h2d["pinned_gbps"],
    )
    return row


def _flat(v: Any) -> Any:
    return "+".join(v) if isinstance(v, tuple) else (str(v) if dataclasses.is_dataclass(v) else v)


def write_sweep(results: list[PointResult], out: Path, base: dict[str, Any]) -> list[Path]:
    """sweep.json (base config, every point's values and summary) and sweep.csv."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [sweep_row(r) for r in results]
    doc = {
        "base_config": base,
        "points": [
            {
                "label": r.label,
                "values": r.values,
                "config": r.config.to_dict(),
                "summary": r.summary,
            }
            for r in results
        ],
    }
    paths = [out / "sweep.json", out / "sweep.csv"]
    paths[0].write_text(json.dumps(_clean(doc), indent=1, default=_flat))
    _csv(paths[1], rows, list(rows[0]) if rows else ["label"])
    return paths


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _pc(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def point_line(res: PointResult) -> str:
    """A few lines of text about one run."""
    s = res.summary
    t, ttft, itl, h2d, ld = s["tiers"], s["ttft"], s["itl"], s["h2d"], s["loads"]
    c = t["counts"]
    lines = [
        f"[{res.label}] {s['requests']['submitted']} requests ({s['requests']['completed']} done, "
        f"{s['requests']['errors']} errors) in {s['measured_s']:.1f}s; "
        f"gpu {c['gpu']} / cpu {c['cpu']} / cold {c['cold']} / base {c['base']} "
        f"(gpu hit {_pc(t['gpu_hit_rate'])}, miss {_pc(t['miss_rate'])})",
        "  TTFT p50/p99 ms: "
        + ", ".join(
            f"{k} {_ms(ttft[k]['p50_s'])}/{_ms(ttft[k]['p99_s'])}"
            for k in ("all", "gpu", "cpu", "cold")
        ),
        f"  ITL p99 with/without load {_ms(itl['with_load']['p99_s'])}/{_ms(itl['without_load']['p99_s'])} ms "
        f"-> decode-stall ratio {_num(s['decode_stall_ratio'])} "
        f"(decode steps: {_num(s['decode_steps']['ratio_p99'])})",
        f"  loads {ld['count']} ({ld['fetched']} fetched, {ld['restaged']} re-staged, {ld['failed']} failed), "
        f"{ld['bytes_fetched'] / 1e6:.1f} MB fetched, mean {_ms(ld['total']['mean_s'])} ms "
        f"(of which waiting for host memory {_ms(ld['stages']['host_wait']['mean_s'])}); "
        f"evictions gpu {s['engine']['adapters'].get('gpu_evictions')} cpu {s['engine']['adapters'].get('cpu_evictions')}",
        f"  H2D GB/s: slot writes (events) p50 {_num(h2d['event_gbps_p50'])}, write_slot copy "
        f"{_num(h2d['write_slot_gbps'])}, pinned {_num(h2d['pinned_gbps'], '.1f') if h2d['pinned_gbps'] else 'n/a'}"
        + (
            f" ({_pc(h2d['write_slot_vs_pinned'])} of pinned)"
            if h2d["write_slot_vs_pinned"]
            else ""
        ),
    ]
    b = s.get("backlog")
    if b and b["windows"]:
        lines.append(
            f"  load path: {_num(b['loads_per_s'], '.1f')} loads/s ended over the arrivals "
            f"({_num(b['cold_per_s'], '.1f')} cold requests/s); by thirds, cold requests waiting "
            + " / ".join(_num(w["waiting_mean"], ".1f") for w in b["windows"])
            + ", cold TTFT p50 ms "
            + " / ".join(_ms(w["cold_ttft_p50_s"]) for w in b["windows"])
            + (" -> keeps up" if b["sustained"] else " -> does NOT keep up (queue grows)")
        )
    cpu = s.get("cpu")
    if cpu and (cpu["threads"] or cpu["children"]["count"]):
        ch = cpu["children"]
        lines.append(
            "  CPU (cores) over the run: "
            + ", ".join(f"{k} {v:.2f}" for k, v in list(cpu["threads"].items())[:6])
            + (
                f"; {ch['count']} child processes {ch['cores']:.2f} (busiest {ch['busiest']:.2f})"
                if ch["count"]
                else ""
            )
        )
    y = s.get("yardstick")
    if y:
        lines.append(
            f"  warm yardstick (same trace, adapters pre-staged, {y['warm_misses']} misses): "
            f"ITL p99 cold/warm {_ms(y['cold_itl']['p99_s'])}/{_ms(y['warm_itl']['p99_s'])} ms "
            f"-> {_num(y['ratio_p99'])} (with a load in flight: {_num(y['with_load_ratio_p99'])})"
        )
        ci = y.get("ratio_p99_interval")
        if ci:
            lines.append(
                f"  cold / warm ITL p99, 95 % interval (paired 2 s block bootstrap): "
                f"{_num(ci[0])}-{_num(ci[1])}"
            )
        pc, pw = (
            (y.get("prefill_steps") or {}).get("cold"),
            (y.get("prefill_steps") or {}).get("warm"),
        )
        if pc and pw and pc["n"] and pw["n"]:
            lines.append(
                "  prefill steps cold/warm: "
                + ", ".join(
                    f"{label} {_fmt(pc[k])}/{_fmt(pw[k])}"
                    for label, k, _fmt in (
                        ("n", "n", str),
                        ("tokens p50", "tokens_p50", lambda x: _num(x, ".0f")),
                        ("tokens p99", "tokens_p99", lambda x: _num(x, ".0f")),
                        ("ms p50", "p50_s", _ms),
                        ("ms p99", "p99_s", _ms),
                        ("ms/1k tokens p50", "s_per_ktok_p50", _ms),
                    )
                )
            )
    if not s["consistency"]["ok"]:
        lines.append(f"  WARNING: tiers / counters disagree: {s['consistency']}")
    return "\n".join(lines)
