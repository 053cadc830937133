"""``python -m benchmarks.storm``: flags, the run, the table, JSON and timeline files."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from benchmarks.storm.report import plot_timeline, table
from benchmarks.storm.run import run
from benchmarks.storm.sustained import add_flags

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few seconds")
    ap.add_argument(
        "--shape", default="llama3-8b", choices=["llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b"],
        help="the base model's shape (random weights); --smoke: the tiny one of its family",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    ap.add_argument(
        "--expert-lora", action=argparse.BooleanOptionalAction, default=True,
        help="a mixture-of-experts shape: adapters on every expert too (else attention only)",
    )  # fmt: skip
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--resident", type=int, default=4)
    ap.add_argument("--storms", type=int, nargs="*", default=[24, 64], help="none: no storm")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-cpu-loras", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--loader-processes", type=int, default=None)
    ap.add_argument(
        "--max-concurrent-loads", type=int, default=None,
        help="default: the engine's (what `loraplex serve` starts with)",
    )  # fmt: skip
    ap.add_argument("--kv-cache-gb", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--storm-prompt-len", type=int, default=16)
    ap.add_argument("--storm-tokens", type=int, default=8)
    add_flags(ap)
    ap.add_argument("--quiet-s", type=float, default=2.0)
    ap.add_argument("--settle-s", type=float, default=1.5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--commit", default=None, help="the commit to report (default: git HEAD)")
    ap.add_argument("--plot", default=None, help="write the step timeline as a PNG here")
    ap.add_argument(
        "--profile", default=None,
        help="folder: a py-spy --gil profile of each storm window (py-spy must be installed)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in dict(
            streams=4,
            resident=2,
            storms=[3],
            rank=8,
            max_loras=4,
            max_cpu_loras=6,
            prompt_len=16,
            # the streams outlast every window on a fast CPU too (cancelled at the end);
            # TINY's 2048 positions bound it
            max_tokens=1900,
            quiet_s=0.5,
            settle_s=0.3,
        ).items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)  # fmt: skip
    result = asyncio.run(run(args))
    print(table(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    if args.plot:
        plot_timeline(result, args.plot)
    return result
