"""``loraplex bench coldload``: the cold-load study's flags and its run.

The ``loraplex`` command registers the study from ``add_arguments`` and ``run`` (this module
never imports the command line back); ``main`` serves ``python -m loraplex.engine.bench.coldload``.
Import-light on purpose (the ``loraplex`` parser imports this module for every command):
the engine's model and matplotlib are imported when a study runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from loraplex.engine.bench.coldload.config import (
    EVICTIONS,
    SOURCES,
    SYNTHETIC,
    Lengths,
    PointConfig,
)

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "point_from_args", "run", "main"]

HELP = "cold-load latency study"
DESCRIPTION = (
    "Cold-load latency study: synthetic adapters served by name from a local folder, S3 or "
    "a Hub, an open-loop workload, and each request's TTFT split into its stages."
)

_D = PointConfig()  # defaults


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model").add_mutually_exclusive_group()
    m.add_argument("--model", metavar="DIR", help="a real checkpoint folder")
    m.add_argument(
        "--synthetic",
        choices=SYNTHETIC,
        default=_D.synthetic,
        help="random-weight model built in-process (tiny: CPU in seconds)",
    )
    g = p.add_argument_group("adapters")
    g.add_argument("--num-adapters", type=int, default=_D.num_adapters)
    g.add_argument("--rank", type=int, default=_D.rank)
    g.add_argument("--targets", default=",".join(_D.targets), help="comma-separated modules")
    g.add_argument(
        "--distinct",
        type=int,
        default=_D.distinct,
        metavar="K",
        help="only K distinct weight files, hardlinked by the other adapters (0: all)",
    )
    g.add_argument("--source", choices=SOURCES, default=_D.source)
    w = p.add_argument_group("workload (open loop)")
    w.add_argument("--rate", type=float, default=_D.rate, help="Poisson arrivals, requests/s")
    w.add_argument("--duration", type=float, default=_D.duration, help="seconds of arrivals")
    w.add_argument("--alpha", type=float, default=_D.alpha, help="Zipf exponent of popularity")
    w.add_argument("--base-fraction", type=float, default=_D.base_fraction)
    w.add_argument("--prompt-len", default=str(_D.prompt_len), help="N or LO-HI (uniform)")
    w.add_argument("--output-len", default=str(_D.output_len), help="N or LO-HI (uniform)")
    w.add_argument("--seed", type=int, default=_D.seed)
    e = p.add_argument_group("engine")
    e.add_argument("--device", default=_D.device, help="auto, cpu, cuda")
    e.add_argument("--dtype", default=_D.dtype, choices=("auto", "float32", "bfloat16", "float16"))
    e.add_argument("--max-loras", type=int, default=_D.max_loras, help="GPU slots")
    e.add_argument("--max-cpu-loras", type=int, default=_D.max_cpu_loras, help="CPU tier")
    e.add_argument("--max-num-seqs", type=int, default=_D.max_num_seqs)
    e.add_argument("--max-num-batched-tokens", type=int, default=_D.max_num_batched_tokens)
    e.add_argument("--kv-cache-gb", type=float, default=_D.kv_cache_gb, help="0: engine default")
    e.add_argument("--no-cuda-graphs", action="store_true")
    e.add_argument(
        "--max-concurrent-loads", type=int, default=_D.max_concurrent_loads,
        help="cold loads at once (0: the engine's default)",
    )  # fmt: skip
    e.add_argument(
        "--loader-processes", type=int, default=_D.loader_processes,
        help="loader helper processes (-1: the engine's default)",
    )  # fmt: skip
    e.add_argument(
        "--adapter-eviction", choices=EVICTIONS, default=_D.adapter_eviction,
        help="both adapter tiers' eviction policy (--sweep adapter_eviction=lru,gdf: the A/B "
        "on one trace)",
    )  # fmt: skip
    r = p.add_argument_group("run")
    r.add_argument(
        "--sweep",
        nargs="+",
        default=[],
        metavar="KEY=V1,V2",
        help="grid over PointConfig fields, e.g. max_loras=8,32 alpha=0.8,1.1 "
        "(targets: q_proj+v_proj,...)",
    )
    r.add_argument("--out", default="coldload-out", help="output folder")
    r.add_argument("--workdir", default=None, help="adapter files (default: a temp dir)")
    r.add_argument("--keep-workdir", action="store_true")
    r.add_argument(
        "--drain-timeout",
        type=float,
        default=_D.drain_timeout,
        help="seconds to let in-flight requests finish after the arrivals",
    )
    r.add_argument("--no-warmup", action="store_true")
    r.add_argument(
        "--warm-yardstick",
        action="store_true",
        help="run each point twice: as given, then the same trace with every adapter it uses "
        "pre-staged in the CPU tier (no cold loads); report cold / warm ITL p99",
    )
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--quiet", action="store_true", help="only the final summary")
    r.add_argument(
        "--log-level", default="warning", help="engine log level (info: a line per request)"
    )


def point_from_args(args: argparse.Namespace) -> PointConfig:
    return PointConfig(
        model=args.model,
        synthetic=args.synthetic,
        device=args.device,
        dtype=args.dtype,
        num_adapters=args.num_adapters,
        rank=args.rank,
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        distinct=args.distinct,
        source=args.source,
        rate=args.rate,
        duration=args.duration,
        alpha=args.alpha,
        base_fraction=args.base_fraction,
        prompt_len=Lengths.parse(args.prompt_len),
        output_len=Lengths.parse(args.output_len),
        seed=args.seed,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gb=args.kv_cache_gb,
        cuda_graphs=not args.no_cuda_graphs,
        max_concurrent_loads=args.max_concurrent_loads,
        loader_processes=args.loader_processes,
        adapter_eviction=args.adapter_eviction,
        warmup=not args.no_warmup,
        drain_timeout=args.drain_timeout,
        warm_yardstick=args.warm_yardstick,
    )


def _check_extras(point: PointConfig, sweep: dict, *, plots: bool) -> None:
    """Fail before the run, not after it, when a module of the ``bench`` extra is missing."""
    need = []
    if plots:
        need.append(("matplotlib", "plots (or pass --no-plots)"))
    if "s3" in (point.source, *sweep.get("source", ())):
        need.append(("moto", "the s3 source"))
    missing = [f"{mod} for {why}" for mod, why in need if importlib.util.find_spec(mod) is None]
    if missing:
        raise ValueError(
            f"missing {'; '.join(missing)}: install the bench extra: pip install -e '.[bench]' in a checkout"
        )


def run(args: argparse.Namespace) -> int:
    from loraplex.engine.bench.coldload.config import parse_sweep
    from loraplex.engine.bench.coldload.sweep import run_study
    from loraplex.engine.logging import configure_logging

    try:
        point = point_from_args(args)
        sweep = parse_sweep(args.sweep)
        _check_extras(point, sweep, plots=not args.no_plots)
        configure_logging(args.log_level)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    study = run_study(
        point,
        Path(args.out),
        sweep=sweep,
        workdir=Path(args.workdir) if args.workdir else None,
        keep_workdir=args.keep_workdir,
        plots=not args.no_plots,
        progress=not (args.no_progress or args.quiet),
        quiet=args.quiet,
    )
    print(study.text)
    print(f"wrote {len(study.files)} files into {args.out}")
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """``python -m loraplex.engine.bench.coldload [flags]`` (the same as ``loraplex bench
    coldload``)."""
    p = argparse.ArgumentParser(
        prog=prog or "python -m loraplex.engine.bench.coldload",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except KeyboardInterrupt:
        return 130
