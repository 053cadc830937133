"""fp8 base projections on the GPU: the W8A16 Triton augmented GEMM against bf16.

For each projection of a model shape (Llama-3-8B by default) and each batch size, times as
the engine runs them (CUDA-graph replays of ``--reps`` calls):

- ``bf16``: ``F.linear`` on the bf16 augmented weight [W; A] (the bf16 decode GEMM);
- ``fp8``: ``fp8_aug_linear`` (kernels/fp8_linear.py) with the engine's own config
  (``fp8_linear_config``: on sm_90 the ``CONFIGS`` table, else the heuristic), and the best of a sweep
  of tile shapes and split-K factors. The sweep's pick per (N, K, token tile) is printed as a
  ``CONFIGS`` table to paste into the kernel module. These are the tensor-core kernel, with
  its config passed explicitly, also at the token counts where the engine runs the GEMV.
- ``gemv`` (at ``--gemv-batches``, 1 and 2 tokens by default): the CUDA-core GEMV the engine
  runs up to ``GEMV_MAX_TOKENS`` tokens, with its own config (``fp8_gemv_config``) and the
  best of a sweep (rows per program, K step, split-K, warps, accumulator kind, pipelining,
  unrolling), next to bf16 and the tensor-core kernel. Printed last: a compact table (with
  the per-layer sums) and the ``GEMV_CONFIGS`` table to paste.

Bytes: weight bytes (fp8 base + scales + bf16 A rows) + activations in and out; the floor is
bytes over ``--bandwidth`` (the copy bandwidth measured in the same run unless given). Checks
every kernel's output against the float32 twin first. ``--copies N`` cycles each timed call
through N copies of the weights, so that a projection smaller than the 50 MB L2 (o and qkv
in fp8) is read from memory as in a decode step, not from L2 left warm by the previous call.

    python -m benchmarks.fp8_gemm --out results.json
    python -m benchmarks.fp8_gemm --gemv-only --copies 4 --out gemv.json  # the GEMV only
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.record import git_commit
from loraplex.engine.model.gemm import _time_ms  # CUDA-graph replays of ``reps`` calls
from loraplex.engine.model.kernels.fp8_linear import (
    GEMV_MAX_TOKENS,
    Fp8GemvConfig,
    Fp8LinearConfig,
    fp8_aug_linear,
    fp8_aug_linear_torch,
    fp8_gemv_config,
    fp8_linear_config,
    prepare_fp8_linear,
)
from loraplex.engine.model.quant import quantize_fp8

SHAPES = {  # name -> (hidden, intermediate, q_size, kv_size)
    "llama3-8b": (4096, 14336, 4096, 1024),
    "llama3-70b": (8192, 28672, 8192, 1024),
}


def projections(shape: str, slots: int, rank: int) -> list[tuple[str, int, int, int]]:
    """(name, N, K, E) per projection: E = slices * slots * rank A rows."""
    h, inter, q, kv = SHAPES[shape]
    return [
        ("qkv", q + 2 * kv, h, 3 * slots * rank),
        ("o", h, q, slots * rank),
        ("gate_up", 2 * inter, h, 2 * slots * rank),
        ("down", h, inter, slots * rank),
    ]


def sweep_configs(block_m: int, k: int) -> list[Fp8LinearConfig]:
    out = []
    for bn, bk, split in itertools.product((64, 128), (128, 256), (1, 2, 4, 8)):
        if k % (split * bk) or k // split < 2 * bk:
            continue
        stages = 4 if 4 * (bn * bk + block_m * bk * 2) <= 160_000 else 3
        out.append(Fp8LinearConfig(block_m, bn, bk, split, num_warps=4, num_stages=stages))
    return out


# GEMV sweep: (rows per program, K step, warps, stages, unroll, per-row sums). Per-row sums
# (early_sum) keep registers for loads in flight (40 at one token for 16 x 256 on sm_90);
# per-column accumulators (early_sum=False) have no shuffles in the loop but take one
# float32 register per weight of the step; stages > 1 pipeline the loads through shared
# memory (cp.async), unroll > 1 gives the compiler two steps' loads to schedule. Per-row
# sums stay at <= 256 columns a step (wider spans warps: a sum through shared memory).
GEMV_BASES = [
    (16, 256, 4, 1, 1, True),
    (32, 256, 4, 1, 1, True),
    (32, 256, 8, 1, 1, True),
    (32, 128, 4, 1, 1, True),
    (64, 128, 4, 1, 1, True),
    (16, 256, 8, 1, 1, True),
    (16, 256, 4, 1, 2, True),
    (16, 256, 4, 3, 1, True),
    (16, 256, 4, 1, 1, False),
    (8, 256, 4, 1, 1, False),
    (8, 512, 4, 1, 2, False),
]


def gemv_sweep_configs(n: int, k: int, e: int) -> list[Fp8GemvConfig]:
    """GEMV_BASES x split-K 1-8, where K divides and the grid stays within ~16 per SM."""
    out = []
    for bn, bk, warps, stages, unroll, early in GEMV_BASES:
        tiles = -(-n // bn) - (-e // bn)
        for split in (1, 2, 4, 8):
            if k % (split * bk) or k // split < 2 * bk or (split > 1 and tiles * split > 2200):
                continue
            out.append(Fp8GemvConfig(bn, bk, split, warps, stages, unroll, early))
    return out


def gemv_cfg_str(c: Fp8GemvConfig) -> str:
    acc = "rowsum" if c.early_sum else "colacc"
    return f"{c.block_n}x{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages} u{c.unroll} {acc}"


def cycled(calls: list, reps: int) -> float:
    """``_time_ms`` of the calls in turn (one per weight copy): consecutive calls of the
    captured graph read different copies."""
    it = itertools.cycle(calls)
    return _time_ms(lambda: next(it)(), reps)


def timed_configs(x: torch.Tensor, copies: list, cfgs: list, ref: torch.Tensor, label: str,
                  reps: int) -> dict:  # fmt: skip
    """cfg -> ms of ``fp8_aug_linear(x, ...)`` (cycling through the weight ``copies``: (fp8
    weight, scales, A rows, ...) each) for each config whose output matches ``ref`` (relative
    error < 1e-2)."""
    times = {}
    for cfg in cfgs:
        if cfg in times:
            continue
        try:
            got = fp8_aug_linear(x, *copies[0][:3], config=cfg).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                print(f"  WRONG {label} {cfg}: relative error {err:.3g}")
                continue
            calls = [functools.partial(fp8_aug_linear, x, *c[:3], config=cfg) for c in copies]
            times[cfg] = cycled(calls, reps)
        except Exception as ex:  # noqa: BLE001 - out of shared memory etc.
            print(f"  skip {cfg}: {type(ex).__name__}: {str(ex)[:120]}")
    return times


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _time_ms(lambda: y.copy_(x), 10)
    return 2 * x.numel() / (ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--gemv-batches", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--gemv-only", action="store_true", help="only the GEMV rows")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copies", type=int, default=1, help="weight copies cycled per call")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s of the floor")
    ap.add_argument("--no-sweep", action="store_true", help="only the engine's own config")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    prepare_fp8_linear(dev)
    bw = args.bandwidth or copy_bandwidth()
    rows, best_of, gemv_rows, gemv_best = [], {}, [], {}
    print(f"commit {git_commit()}  device {torch.cuda.get_device_name()}  shape {args.shape}  "
          f"copy bandwidth {bw / 1e12:.2f} TB/s  weight copies {args.copies}")  # fmt: skip
    hdr = f"{'proj':8} {'T':>4} {'bf16 us':>8} {'fp8 us':>8} {'best us':>8} {'best cfg':24} "
    if not args.gemv_only:
        print(hdr + f"{'floor us':>8} {'own/floor':>9} {'own/bf16':>8} {'best/bf16':>9}")
    for name, n, k, e in projections(args.shape, args.slots, args.rank):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q, scale = quantize_fp8(w)
        q, scale = q.contiguous(), scale.float().reshape(n, 1).contiguous()
        a = torch.randn(e, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_aug = torch.cat([w, a])
        del w
        copies = [(q, scale, a, w_aug)] + [
            tuple(z.clone() for z in (q, scale, a, w_aug)) for _ in range(args.copies - 1)
        ]
        for t in [] if args.gemv_only else args.batches:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_aug_linear_torch(x, q, scale, a).float()
            bf16_ms = cycled([functools.partial(F.linear, x, c[3]) for c in copies], args.reps)
            own = fp8_linear_config(t, n, k, k, dev)
            cfgs = [own] + ([] if args.no_sweep else sweep_configs(own.block_m, k))
            times = timed_configs(x, copies, cfgs, ref, f"{name} T={t}", args.reps)
            if own not in times:
                raise SystemExit(f"{name} T={t}: the engine's config failed")
            own_ms = times[own]
            best = min(times, key=times.__getitem__)
            best_ms = times[best]
            key = (n, k, own.block_m)
            agg = best_of.setdefault(key, {})
            for cfg, ms in times.items():
                agg[cfg] = agg.get(cfg, 0.0) + ms / bf16_ms  # summed over the bucket's T
            fp8_bytes = n * k + n * 4 + e * k * 2 + t * k * 2 + t * (n + e) * 2
            floor_ms = fp8_bytes / bw * 1e3
            row = {
                "proj": name, "T": t, "N": n, "K": k, "E": e, "bf16_ms": bf16_ms,
                "fp8_ms": own_ms, "fp8_cfg": own.__dict__, "best_ms": best_ms,
                "best_cfg": best.__dict__, "fp8_floor_ms": floor_ms,
                "all": [[c.__dict__, ms] for c, ms in times.items()],
            }  # fmt: skip
            rows.append(row)
            cfg_s = f"{best.block_m}x{best.block_n}x{best.block_k} s{best.split_k}"
            print(
                f"{name:8} {t:4} {bf16_ms * 1e3:8.1f} {own_ms * 1e3:8.1f} {best_ms * 1e3:8.1f} "
                f"{cfg_s:24} {floor_ms * 1e3:8.1f} {own_ms / floor_ms:9.2f} "
                f"{own_ms / bf16_ms:8.2f} {best_ms / bf16_ms:9.2f}",
                flush=True,
            )
        for t in args.gemv_batches:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_aug_linear_torch(x, q, scale, a).float()
            bf16_ms = cycled([functools.partial(F.linear, x, c[3]) for c in copies], args.reps)
            tc = fp8_linear_config(t, n, k, k, dev)  # the tensor-core kernel at this T
            tc_ms = timed_configs(x, copies, [tc], ref, f"{name} T={t}", args.reps).get(tc)
            own = fp8_gemv_config(t, n, k, k, e, dev)
            cfgs = [own] + ([] if args.no_sweep else gemv_sweep_configs(n, k, e))
            times = timed_configs(x, copies, cfgs, ref, f"{name} T={t} gemv", args.reps)
            if own not in times:
                raise SystemExit(f"{name} T={t}: the GEMV's own config failed")
            best = min(times, key=times.__getitem__)
            gemv_best.setdefault((n, k, t), times)
            fp8_bytes = n * k + n * 4 + e * k * 2 + t * k * 2 + t * (n + e) * 2
            row = {
                "proj": name, "T": t, "N": n, "K": k, "E": e, "bytes": fp8_bytes,
                "bf16_ms": bf16_ms, "tc_ms": tc_ms, "tc_cfg": tc.__dict__,
                "gemv_ms": times[own], "gemv_cfg": own.__dict__, "best_ms": times[best],
                "best_cfg": best.__dict__, "fp8_floor_ms": fp8_bytes / bw * 1e3,
                "engine": "gemv" if t <= GEMV_MAX_TOKENS else "tensor-core",
                "all": [[c.__dict__, ms] for c, ms in times.items()],
            }  # fmt: skip
            gemv_rows.append(row)
            print(
                f"gemv {name:8} T={t}  bf16 {bf16_ms * 1e3:.1f} us  tensor-core "
                f"{(tc_ms or float('nan')) * 1e3:.1f} us  gemv own {times[own] * 1e3:.1f} us  "
                f"best {times[best] * 1e3:.1f} us ({gemv_cfg_str(best)})",
                flush=True,
            )
        del q, scale, a, w_aug, copies
    if best_of:
        print("CONFIGS = {  # (N, K, block_m) -> best of the sweep, summed over the bucket's T")
        for key, agg in best_of.items():
            c = min(agg, key=agg.__getitem__)
            print(f"    {key}: Fp8LinearConfig({c.block_m}, {c.block_n}, {c.block_k}, "
                  f"{c.split_k}, {c.num_warps}, {c.num_stages}),")  # fmt: skip
        print("}")
    if gemv_rows:
        print_gemv_summary(gemv_rows, gemv_best, bw)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": git_commit(), "shape": args.shape, "bandwidth": bw,
                       "copies": args.copies, "rows": rows, "gemv_rows": gemv_rows},
                      f, indent=1)  # fmt: skip


def print_gemv_summary(gemv_rows: list[dict], gemv_best: dict, bw: float) -> None:
    """The compact GEMV table (per projection and T, then the per-layer sums) and the
    ``GEMV_CONFIGS`` table of the sweep's picks."""
    print(f"\nGEMV (fp8 floor at {bw / 1e12:.2f} TB/s; TB/s = fp8 bytes / best time)")
    print(f"{'proj':8} {'T':>2} {'bf16':>7} {'tc':>7} {'gemv':>7} {'best':>7} {'floor':>6} "
          f"{'TB/s':>5} {'b/floor':>7} {'b/bf16':>6}  best config")  # fmt: skip
    sums: dict[int, list[float]] = {}
    for r in gemv_rows:
        tc = r["tc_ms"] if r["tc_ms"] is not None else float("nan")
        vals = [r["bf16_ms"], tc, r["gemv_ms"], r["best_ms"], r["fp8_floor_ms"]]
        acc = sums.setdefault(r["T"], [0.0] * 5)
        for i, v in enumerate(vals):
            acc[i] += v
        print(
            f"{r['proj']:8} {r['T']:2} {vals[0] * 1e3:7.1f} {vals[1] * 1e3:7.1f} "
            f"{vals[2] * 1e3:7.1f} {vals[3] * 1e3:7.1f} {vals[4] * 1e3:6.1f} "
            f"{r['bytes'] / r['best_ms'] / 1e9:5.2f} {vals[3] / vals[4]:7.2f} "
            f"{vals[3] / vals[0]:6.2f}  {gemv_cfg_str(Fp8GemvConfig(**r['best_cfg']))}"
        )
    for t, v in sums.items():
        print(
            f"{'layer':8} {t:2} {v[0] * 1e3:7.1f} {v[1] * 1e3:7.1f} {v[2] * 1e3:7.1f} "
            f"{v[3] * 1e3:7.1f} {v[4] * 1e3:6.1f} {'':5} {v[3] / v[4]:7.2f} {v[3] / v[0]:6.2f}"
        )
    print("GEMV_CONFIGS = {  # (N, K, tokens) -> best of the sweep")
    for key, times in gemv_best.items():
        c = min(times, key=times.__getitem__)
        print(f"    {key}: Fp8GemvConfig({c.block_n}, {c.block_k}, {c.split_k}, {c.num_warps}, "
              f"{c.num_stages}, {c.unroll}, {c.early_sum}),")  # fmt: skip
    print("}")


if __name__ == "__main__":
    main()
