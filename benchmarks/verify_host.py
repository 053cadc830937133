"""What verifying a speculative step costs after its forward (issue 45): ``spec/verify.py``'s
``verify(...).fetch()`` over the logits of R rows of K = 4 proposed tokens, greedy, no
logprobs, with the argmax-only path (``PendingGreedy``) and with the general path (forced),
alternating, in one run. On a GPU this runs between two graph replays, on the step's
critical path (verification steps are never pipelined); on the CPU it is plain CPU time.

    python -m benchmarks.verify_host [--device cuda] [--vocab 128256] [--rows 1 2 4 8] [--dtype D]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.record import git_commit
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.spec import verify as vmod

K = 4


def one(sampler: Sampler, logits: torch.Tensor, rows: list, general: bool) -> float:
    keep = vmod._plain_greedy
    if general:
        vmod._plain_greedy = lambda rows, masks: False
    try:
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        vmod.verify(sampler, logits, rows).fetch()
        return time.perf_counter() - t0
    finally:
        vmod._plain_greedy = keep


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument(
        "--dtype",
        default=None,
        help="logits dtype (default: the engine's: bf16 on CUDA, fp32 on CPU)",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    sampler = Sampler(seed=0)
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"verify + fetch, {name}, {dtype} logits, vocab {args.vocab}, K = {K}, greedy rows, median of "
          f"{args.repeats}, commit {git_commit() or 'unknown'}")  # fmt: skip
    print("| rows | general path us | argmax path us | saved |")
    print("|---:|---:|---:|---:|")
    for r in args.rows:
        logits = torch.randn(r * (K + 1), args.vocab, generator=g).to(device, dtype)
        am = logits.float().argmax(-1).tolist()
        rows = [
            vmod.VerifyRow(greedy, None, am[i * (K + 1) : i * (K + 1) + 2] + [0, 0])
            for i in range(r)
        ]  # fmt: skip  (two kept, then a correction)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.repeats + 10):
            for general in (False, True) if i % 2 else (True, False):
                t = one(sampler, logits, rows, general)
                if i >= 10:
                    times[general].append(t)
        slow, fast = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {r} | {slow * 1e6:.0f} | {fast * 1e6:.0f} | {1 - fast / slow:.0%} |")


if __name__ == "__main__":
    main()
