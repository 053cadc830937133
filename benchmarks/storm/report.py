"""The storm benchmark's report: windows, drift-corrected ratios, the table and the timeline."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Window",
    "pct",
    "ends_in",
    "ttft_breakdown",
    "drift_corrected",
    "table",
    "plot_timeline",
]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


@dataclass
class Window:
    name: str
    t0: float
    t1: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def ends_in(w: Window, a: float, b: float) -> bool:
    """A gap (a, b) belongs to the window it ends in: a stall that a window's first action
    causes (e.g. 64 registrations handled at once on the loop) counts there even though the
    gap began just before it; windows are contiguous, so each gap counts once."""
    return w.t0 < b <= w.t1


def ttft_breakdown(
    reqs: list[tuple[str, float, float]],
    loads: list[dict],
    writes: list[tuple[float, dict]],
    step_s: float,
) -> dict[str, Any]:
    """Each storm request's TTFT split: waiting for a load turn (``max_concurrent_loads``),
    its own load (stage, plus fetch + verify if it ran now), waiting for a slot, and the rest
    in steps. ``reqs``: (adapter, sent, first token) perf_counter times. The target of the
    issue ("TTFT <= its fetch + verify + stage + 2 steps" for a request whose adapter can get a
    free slot) is checked on the requests whose slot write began within one step of their
    load ending (a slot was free)."""
    load = {d["name"]: d for d in loads if d.get("ok")}
    landed = {d["name"]: (t, d.get("h2d_s") or 0.0) for t, d in writes}
    out = []
    for name, sent, first in reqs:
        d, w = load.get(name), landed.get(name)
        if d is None or w is None:
            continue
        own = d.get("total_s", 0.0)
        began = d["t"] - own
        write_start = w[0] - w[1]
        out.append({
            "ttft_s": first - sent,
            "load_wait_s": max(0.0, began - sent),
            "own_load_s": own,
            "slot_wait_s": max(0.0, write_start - d["t"]),
            "steps_after_load": (first - max(began, sent) - own) / step_s,
        })  # fmt: skip
    free = [r for r in out if r["slot_wait_s"] <= step_s]
    return {
        "requests": len(out),
        "free_slot": len(free),
        "free_slot_steps_after_load_max": max((r["steps_after_load"] for r in free), default=None),
        "free_slot_load_wait_max_s": max((r["load_wait_s"] for r in free), default=None),
        "steps_after_load_p50": pct([r["steps_after_load"] for r in out], 50) if out else None,
        "per_request": out,
    }


def drift_corrected(rows: list[dict], times: list[list[float]], windows: list[Window]) -> None:
    """Add ratios of each load window to the quiet window just before it, with the decode
    step's slow drift taken out: a step reads more KV as contexts grow (~+8 % per 500 tokens
    at 32 streams of the 8B shape), so a later window is slower even without loads. Each gap
    is scaled by p50(before) / trend(t), the trend a line through the p50s of the quiet
    windows before and after it."""
    by_name = {r["window"]: r for r in rows}
    order = [w.name for w in windows]
    for i, w in enumerate(windows):
        if not w.name.startswith(("register", "requests", "sustained")):
            continue
        before, after = windows[i - 1], windows[i + 1] if i + 1 < len(windows) else None
        qb = by_name[before.name]
        tb, pb = (before.t0 + before.t1) / 2, qb["gap_p50_ms"]
        if after is not None and by_name[after.name]["gaps"]:
            ta, pa = (after.t0 + after.t1) / 2, by_name[after.name]["gap_p50_ms"]
        else:
            ta, pa = tb + 1.0, pb

        def trend(t: float, tb=tb, pb=pb, ta=ta, pa=pa) -> float:
            return pb + (pa - pb) * (t - tb) / (ta - tb)

        norm = [
            (b - a) * 1e3 * pb / trend((a + b) / 2)
            for ts in times
            for a, b in itertools.pairwise(ts)
            if ends_in(w, a, b)
        ]
        row = by_name[w.name]
        row["reference"] = before.name
        row["p99_vs_quiet"] = pct(norm, 99) / qb["gap_p99_ms"] if norm else float("nan")
        row["max_vs_quiet_p50"] = max(norm) / pb if norm else float("nan")
        row["raw_p99_vs_quiet"] = row["gap_p99_ms"] / qb["gap_p99_ms"]
        row["raw_max_vs_quiet_p50"] = row["gap_max_ms"] / pb
    assert order  # (windows keep their order)


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"{result['date']}, commit {result['commit']}, {result['device']}; "
        f"compiles while serving: {result['compiles_while_serving']}",
        "",
        "| window | s | gaps | gap p50 / p99 / max (ms) | p99 / quiet p99 | max / quiet p50 "
        "| (raw) | loop lag p99 / max (ms) | compiles | TTFT p50 / max (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ttft = f"{r['ttft_p50_s']:.2f} / {r['ttft_max_s']:.2f}" if "ttft_p50_s" in r else ""
        ratios = raw = ""
        if "p99_vs_quiet" in r:
            ratios = f"{r['p99_vs_quiet']:.3f} | {r['max_vs_quiet_p50']:.2f}"
            raw = f"{r['raw_p99_vs_quiet']:.2f} / {r['raw_max_vs_quiet_p50']:.2f}"
        else:
            ratios = " | "
        lines.append(
            f"| {r['window']} | {r['seconds']:.1f} | {r['gaps']} | {r['gap_p50_ms']:.2f} / "
            f"{r['gap_p99_ms']:.2f} / {r['gap_max_ms']:.2f} | {ratios} | {raw} | "
            f"{r['loop_lag_p99_ms']:.2f} / {r['loop_lag_max_ms']:.2f} | {r['compiles']} | {ttft} |"
        )
    w = result.get("idle_slot_writes") or {}
    if w:
        lines += ["", (
            f"Idle slot writes (transfer + scatter): {w['full_mb']:.0f} MB at {w['full_gbps']:.1f}"
            f" GB/s ({w['full_gbps'] / w['pinned_gbps']:.0%} of pinned {w['pinned_gbps']:.1f}),"
            f" {w['qkvo_mb']:.0f} MB at {w['qkvo_gbps']:.1f} GB/s "
            f"({w['qkvo_gbps'] / w['pinned_gbps']:.0%}; into a slot of another layout, the rest"
            f" zero-filled: {w.get('qkvo_fill_gbps', float('nan')):.1f} GB/s,"
            f" {w.get('qkvo_fill_gbps', float('nan')) / w['pinned_gbps']:.0%})"
        )]  # fmt: skip
    stages = [r for r in rows if r.get("stage_p50_ms") is not None]
    if stages:
        lines += ["", "Load stages of the storm requests (p50 ms): " + "; ".join(
            f"{r['window']}: fetch {r['fetch_p50_ms']:.0f}, verify {r['verify_p50_ms']:.0f}, "
            f"preflight {r['preflight_p50_ms']:.0f}, stage {r['stage_p50_ms']:.0f}"
            + (
                f"; slot writes of {r['slot_write_mb']:.0f} MB at {r['slot_write_gbps_p50']:.1f}"
                f" GB/s p50 ({r['slot_write_gbps_min']:.1f} min), host->device transfer "
                f"{r.get('h2d_copy_gbps_p50', 0):.1f} GB/s p50"
                if "slot_write_mb" in r else "; no slot write in this window"
            )
            for r in stages
        )]  # fmt: skip
    for r in rows:
        for gap in r.get("largest_gaps", [])[:2]:
            if not r["window"].startswith("requests"):
                break
            steps = ", ".join(
                f"[{e['t_end']:.3f} {e['seconds'] * 1e3:.1f}ms r{e['rows']} t{e['tokens']}"
                f"{' d' if e['decode'] else ''}{' p' if e['pipelined'] else ''}"
                f" h{e['host_s'] * 1e3:.1f} g{e['gpu_ms'] or 0:.1f} w{e['slot_writes']}]"
                for e in gap["steps"]
            )
            lines.append(f"gap {gap['gap_ms']:.1f} ms in {r['window']}: {steps}")
    lines += [sustained_line(r) for r in rows if "sustained" in r]
    for r in rows:
        b = r.get("ttft_breakdown")
        if b and b["free_slot"]:
            lines.append(
                f"TTFT in {r['window']}: {b['free_slot']} of {b['requests']} requests found a free"
                f" slot; they got their first token <= {b['free_slot_steps_after_load_max']:.1f} "
                f"steps after their own load (waited <= {b['free_slot_load_wait_max_s']:.2f} s for"
                f" a load turn); all: p50 {b['steps_after_load_p50']:.1f} steps after their load"
            )
    for r in rows:
        if r.get("thread_cpu") and r["window"].startswith(("quiet", "register", "requests")):
            lines.append(f"CPU by thread in {r['window']} (cores): " + ", ".join(
                f"{k} {v:.2f}" for k, v in list(r["thread_cpu"].items())[:8]
            ))  # fmt: skip
    for r in rows:
        if "gc" in r:
            g = r["gc"]
            lines.append(
                f"{r['window']}: tokens handed to the streams {r['delivery_p50_ms']:.2f} / "
                f"{r['delivery_p99_ms']:.2f} / {r['delivery_max_ms']:.2f} ms (p50 / p99 / max) "
                "after their step's results; GC n / total / max ms: " + ", ".join(
                    f"gen{i} {g[f'gen{i}'][0]} / {g[f'gen{i}'][1]:.1f} / {g[f'gen{i}'][2]:.2f}"
                    for i in range(3)
                ) + (f"; pauses > 0.5 ms in {g['over_0.5ms_by_thread']}"
                     if g["over_0.5ms_by_thread"] else "")
            )  # fmt: skip
    for r in rows:
        if not r["window"].startswith(("register", "requests", "sustained")):
            continue
        if not r.get("slowest_steps"):
            continue
        lines.append(f"slowest steps in {r['window']}: " + "; ".join(
            f"{e['seconds'] * 1e3:.1f} ms (rows {e['rows']}, tokens {e['tokens']}, "
            f"host {e['host_s'] * 1e3:.1f} ms, GPU {e['gpu_ms'] or 0:.1f} ms, writes "
            f"{e['slot_writes']}, in flight {_in_flight(e.get('writes_in_flight', []))})"
            for e in r["slowest_steps"][:4]
        ))  # fmt: skip
    return "\n".join(lines)


def _in_flight(writes: list[dict]) -> str:
    """Slot writes in flight during a step: "none", or each one's span from issue to landing
    relative to the step's start and its GPU ms, e.g. "[-3.1..+9.8 ms, GPU 2.6]"."""
    if not writes:
        return "none"
    return " ".join(
        f"[{w['from_ms']:+.1f}..{w['to_ms']:+.1f} ms, GPU {w['gpu_ms']:.1f}]" for w in writes
    )


def sustained_line(row: dict[str, Any]) -> str:
    """One line for the report: registrations sent, loads ended, their rate and GB/s."""
    s = row["sustained"]
    loads = row.get("loads", 0)
    per_s = loads / s["seconds"] if s["seconds"] > 0 else float("nan")
    return (
        f"{row['window']}: {s['sent']} registrations of {s['mb_each']:.2f} MB sent at "
        f"{s['offered_per_s']:.0f}/s, {loads} images packed ({s['failed']} failed) in "
        f"{s['seconds']:.2f} s: {per_s:.1f} loads/s ({per_s * s['mb_each'] / 1e3:.2f} GB/s); "
        f"stages p50 ms: fetch {row.get('fetch_p50_ms') or 0:.0f}, verify "
        f"{row.get('verify_p50_ms') or 0:.0f}, stage {row.get('stage_p50_ms') or 0:.0f}"
    )


def plot_timeline(result: dict[str, Any], path: str) -> None:
    """Step durations over the run (the gaps every running stream sees), load windows shaded,
    loads finishing and slot writes landing marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    fig, ax = plt.subplots(figsize=(12, 4))
    for name, a, b in tl["windows"]:
        if name.startswith(("register", "requests")):
            ax.axvspan(a, b, color="tab:orange" if name.startswith("requests") else "tab:blue",
                       alpha=0.12)  # fmt: skip
            ax.text(a, 1.02, name, transform=ax.get_xaxis_transform(), fontsize=8)
    steps = tl["steps"]
    ax.plot([x[0] for x in steps], [x[1] for x in steps], lw=0.6, color="black", label="step (ms)")
    for t in tl["loads"]:
        ax.axvline(t, ymax=0.05, color="tab:green", lw=0.6)
    for t in tl["writes"]:
        ax.axvline(t, ymin=0.95, color="tab:red", lw=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("seconds (green ticks: loads staged; red ticks: slot writes landed)")
    ax.set_ylabel("step interval (ms)")
    ax.set_title(f"cold-load storm, {result['device']}, commit {result['commit']}", pad=16)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
