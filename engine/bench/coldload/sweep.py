"""The whole study: one point or a grid of them, one engine per point, files and a summary.

    results = run_study(PointConfig(...), sweep={"max_loras": [8, 32]}, out=Path("out"))

A single run writes its files into ``out``; a sweep writes each point into
``out/points/<label>/`` plus ``sweep.json``, ``sweep.csv`` and ``sweep.png`` into ``out``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loraplex.engine.bench.coldload.adapters import AdapterSet, model_config, write_adapter_set
from loraplex.engine.bench.coldload.config import PointConfig, grid, label_of
from loraplex.engine.bench.coldload.metrics import ratio_interval
from loraplex.engine.bench.coldload.report import point_line, write_point, write_sweep
from loraplex.engine.bench.coldload.run import PointResult, run_point
from loraplex.engine.bench.coldload.servers import hf_cache_env
from loraplex.engine.bench.coldload.sources import SourcePool, environment
from loraplex.engine.bench.coldload.summary import yardstick

__all__ = ["run_study", "Study"]


@dataclasses.dataclass
class Study:
    results: list[PointResult]
    files: list[Path]
    text: str


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


async def _run_all(
    points: list[tuple[dict[str, Any], PointConfig]],
    work: Path,
    out: Path,
    *,
    sweep: bool,
    plots: bool,
    progress: bool,
    quiet: bool,
) -> tuple[list[PointResult], list[Path]]:
    sets: dict[tuple, AdapterSet] = {}
    pool = SourcePool()
    results: list[PointResult] = []
    files: list[Path] = []
    try:
        for i, (values, point) in enumerate(points):
            key = point.adapter_key()
            if key not in sets:
                t0 = time.perf_counter()
                sets[key] = await asyncio.to_thread(
                    write_adapter_set,
                    work / f"set{len(sets)}",
                    model_config(point),
                    num=point.num_adapters,
                    rank=point.rank,
                    targets=point.targets,
                    distinct=point.distinct,
                    seed=point.seed,
                )
                aset = sets[key]
                _say(
                    f"wrote {len(aset.names)} adapters ({aset.distinct} distinct weight files, "
                    f"{aset.folder_bytes / 1e6:.2f} MB each) in {time.perf_counter() - t0:.1f}s",
                    quiet,
                )
            aset = sets[key]
            source = await asyncio.to_thread(pool.get, point.source, aset)
            label = label_of(values)
            env = dict(source.env)
            if point.source == "hub":
                env.update(hf_cache_env(work / f"hf-cache-{i}"))
            _say(f"point {i + 1}/{len(points)}: {label}", quiet)
            dest = out / "points" / label if sweep else out
            with environment(env):
                res = await run_point(
                    point,
                    aset,
                    source.engine_kwargs,
                    work,
                    label=label,
                    values=values,
                    progress=progress,
                )
                if point.warm_yardstick:
                    _say(f"point {i + 1}/{len(points)}: {label}, warm yardstick", quiet)
                    warm = await run_point(
                        point,
                        aset,
                        source.engine_kwargs,
                        work,
                        label=f"{label}-warm",
                        values=values,
                        progress=progress,
                        warm=True,
                    )
                    res.summary["yardstick"] = yardstick(res.summary, warm.summary)
                    res.summary["yardstick"]["ratio_p99_interval"] = ratio_interval(
                        res.itl, warm.itl
                    )
                    files += write_point(warm, dest / "warm")
            if point.source == "hub":
                shutil.rmtree(work / f"hf-cache-{i}", ignore_errors=True)
            files += write_point(res, dest)
            if plots:
                from loraplex.engine.bench.coldload.plots import plot_point

                files += plot_point(res, dest)
            results.append(res)
            if len(points) > 1:
                _say(point_line(res), quiet)
    finally:
        await asyncio.to_thread(pool.close)
    return results, files


def run_study(
    base: PointConfig,
    out: Path,
    *,
    sweep: dict[str, list[Any]] | None = None,
    workdir: Path | None = None,
    keep_workdir: bool = False,
    plots: bool = True,
    progress: bool = True,
    quiet: bool = False,
) -> Study:
    """Run every point; write files into ``out``; return the results and the text summary."""
    sweep = sweep or {}
    points = grid(base, sweep) if sweep else [({}, base)]
    out.mkdir(parents=True, exist_ok=True)
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="coldload-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        results, files = asyncio.run(
            _run_all(
                points, work, out, sweep=bool(sweep), plots=plots, progress=progress, quiet=quiet
            )
        )
    finally:
        if own and not keep_workdir:
            shutil.rmtree(work, ignore_errors=True)
    if sweep:
        files += write_sweep(results, out, base.to_dict())
        if plots:
            from loraplex.engine.bench.coldload.plots import plot_sweep

            p = plot_sweep(results, list(sweep), out / "sweep.png")
            if p is not None:
                files.append(p)
    text = "\n".join(point_line(r) for r in results)
    (out / "summary.txt").write_text(text + "\n")
    files.append(out / "summary.txt")
    return Study(results, files, text)
