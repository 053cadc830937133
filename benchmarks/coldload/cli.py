"""``loraplex bench coldload`` / ``python -m benchmarks.coldload``: the cold-load study.

Import-light on purpose (the ``loraplex`` parser imports this module for every command):
torch, the engine and matplotlib are imported when a study runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.coldload.config import SOURCES, SYNTHETIC, Lengths, PointConfig
from loraplex.engine.server.cli import Subcommand

__all__ = ["COMMAND", "add_coldload_arguments", "run_coldload", "main"]

_D = PointConfig()  # defaults


def add_coldload_arguments(p: argparse.ArgumentParser) -> None:
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
        warmup=not args.no_warmup,
        drain_timeout=args.drain_timeout,
    )


def run_coldload(args: argparse.Namespace) -> int:
    from benchmarks.coldload.config import parse_sweep
    from benchmarks.coldload.sweep import run_study
    from loraplex.engine.logging import configure_logging

    try:
        point = point_from_args(args)
        sweep = parse_sweep(args.sweep)
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


# -- ``loraplex bench ...`` -----------------------------------------------------------------------

BENCHES = {"coldload": (add_coldload_arguments, run_coldload, "cold-load latency study")}


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    for name, (add, run, help_) in BENCHES.items():
        q = sub.add_parser(
            name,
            help=help_,
            description=(__doc__ or "").split("\n")[0],
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        add(q)
        q.set_defaults(_bench_run=run)


def _run_bench(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)


COMMAND = Subcommand(
    name="bench",
    help="benchmarks of a source checkout (coldload)",
    add_arguments=_add_bench_arguments,
    run=_run_bench,
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.coldload [flags]``."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.coldload",
        description="Cold-load latency study of the loraplex engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_coldload_arguments(p)
    try:
        return run_coldload(p.parse_args(argv))
    except KeyboardInterrupt:
        return 130
