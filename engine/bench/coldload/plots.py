"""PNG plots (matplotlib, Agg backend): TTFT CDF by tier, ITL over time with loads marked,
and for sweeps hit rate and p99 TTFT against the swept x (GPU slots) per alpha."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from loraplex.engine.bench.coldload.metrics import TIERS
from loraplex.engine.bench.coldload.run import PointResult

__all__ = ["plot_point", "plot_sweep"]

_COLORS = {"gpu": "tab:green", "cpu": "tab:blue", "cold": "tab:red", "base": "tab:gray"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(res: PointResult, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for tier in TIERS:
        xs = np.sort(
            [
                r["ttft_s"] * 1e3
                for r in res.requests
                if r["tier"] == tier and r["ttft_s"] is not None
            ]
        )
        if xs.size:
            ys = np.arange(1, xs.size + 1) / xs.size
            ax.step(
                xs,
                ys,
                where="post",
                color=_COLORS[tier],
                label=f"{tier} hit ({xs.size})"
                if tier in ("gpu", "cpu")
                else f"{tier} ({xs.size})",
            )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT by tier: {res.label}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_itl_timeline(res: PointResult, path: Path) -> Path:
    plt = _plt()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": (3, 1)}
    )
    if res.itl:
        t = np.array([x[0] for x in res.itl])
        d = np.array([x[1] * 1e3 for x in res.itl])
        w = np.array([x[2] for x in res.itl], dtype=bool)
        top.scatter(t[~w], d[~w], s=2, color="tab:blue", label="no load in flight", rasterized=True)
        top.scatter(t[w], d[w], s=2, color="tab:red", label="load in flight", rasterized=True)
        top.set_yscale("log")
        top.legend(loc="upper right", markerscale=4)
    top.set_ylabel("inter-token latency (ms)")
    top.set_title(f"ITL of running streams: {res.label}")
    top.grid(True, alpha=0.3)
    # loads and slot writes in flight over time, and each load's end as a tick
    edges = sorted(
        [(ld.t_start - res.start, 1) for ld in res.loads]
        + [(ld.t_end - res.start, -1) for ld in res.loads]
    )
    if edges:
        xs, ys, n = [edges[0][0]], [0], 0
        for x, step in edges:
            n += step
            xs.append(x)
            ys.append(n)
        bottom.step(xs, ys, where="post", color="tab:red", label="loads in flight")
    for w in res.writes:
        bottom.axvline(w.t_end - res.start, color="tab:purple", alpha=0.25, lw=0.6)
    bottom.set_ylabel("loads")
    bottom.set_xlabel("time since start (s); purple: slot writes landing")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_point(res: PointResult, out: Path) -> list[Path]:
    return [
        plot_ttft_cdf(res, out / "ttft_cdf.png"),
        plot_itl_timeline(res, out / "itl_timeline.png"),
    ]


def plot_sweep(results: list[PointResult], keys: list[str], path: Path) -> Path | None:
    """Hit rate and p99 TTFT against ``max_loras`` (else the first swept key), one line per
    combination of the other swept keys (alpha, ...)."""
    if not results or not keys:
        return None
    plt = _plt()
    x_key = "max_loras" if "max_loras" in keys else keys[0]
    others = [k for k in keys if k != x_key]
    lines: dict[str, list[PointResult]] = {}
    for r in results:
        name = ", ".join(f"{k}={_text(r.values[k])}" for k in others) or "all"
        lines.setdefault(name, []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    numeric = all(isinstance(r.values[x_key], int | float) for r in results)
    for name, rs in lines.items():
        rs = sorted(rs, key=lambda r: r.values[x_key]) if numeric else rs
        xs = [r.values[x_key] if numeric else _text(r.values[x_key]) for r in rs]
        gpu = [_nan(r.summary["tiers"]["gpu_hit_rate"]) for r in rs]
        cpu = [
            _nan(r.summary["tiers"]["gpu_hit_rate"]) + _nan(r.summary["tiers"]["cpu_hit_rate"])
            for r in rs
        ]
        p99 = [_nan(r.summary["ttft"]["all"]["p99_s"]) * 1e3 for r in rs]
        (line,) = ax1.plot(xs, gpu, marker="o", label=f"{name}: GPU hit")
        ax1.plot(
            xs, cpu, marker="x", ls="--", color=line.get_color(), label=f"{name}: GPU or CPU hit"
        )
        ax2.plot(xs, p99, marker="o", color=line.get_color(), label=name)
    for ax in (ax1, ax2):
        ax.set_xlabel(x_key)
        ax.grid(True, alpha=0.3)
        if numeric:
            ax.set_xticks(sorted({r.values[x_key] for r in results}))
    ax1.set_ylabel("hit rate (adapter requests)")
    ax1.set_ylim(0, 1.02)
    ax1.legend(fontsize=7)
    ax2.set_ylabel("p99 TTFT (ms)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    fig.suptitle("Cold-load sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _text(v: Any) -> str:
    return "+".join(v) if isinstance(v, tuple) else str(v)


def _nan(x: float | None) -> float:
    return float("nan") if x is None else float(x)
