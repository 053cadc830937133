"""fp8 base projections on the GPU: the W8A16 Triton augmented GEMM against bf16.

For each projection of a model shape (Llama-3-8B by default) and each batch size, times as
the engine runs them (CUDA-graph replays of ``--reps`` calls):

- ``bf16``: ``F.linear`` on the bf16 augmented weight [W; A] (the bf16 decode GEMM);
- ``fp8``: ``fp8_aug_linear`` (kernels/fp8_linear.py) with the engine's own config
  (``fp8_linear_config``: the ``CONFIGS`` table, else the heuristic), and the best of a sweep
  of tile shapes and split-K factors. The sweep's pick per (N, K, token tile) is printed as a
  ``CONFIGS`` table to paste into the kernel module.

Bytes: weight bytes (fp8 base + scales + bf16 A rows) + activations in and out; the floor is
bytes over ``--bandwidth`` (the copy bandwidth measured in the same run unless given). Checks
every kernel's output against the float32 twin first.

    python -m benchmarks.fp8_gemm --out results.json
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
    Fp8LinearConfig,
    fp8_aug_linear,
    fp8_aug_linear_torch,
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


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _time_ms(lambda: y.copy_(x), 10)
    return 2 * x.numel() / (ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s of the floor")
    ap.add_argument("--no-sweep", action="store_true", help="only the engine's own config")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    prepare_fp8_linear(dev)
    bw = args.bandwidth or copy_bandwidth()
    rows, best_of = [], {}
    print(f"commit {git_commit()}  device {torch.cuda.get_device_name()}  shape {args.shape}  "
          f"copy bandwidth {bw / 1e12:.2f} TB/s")  # fmt: skip
    hdr = f"{'proj':8} {'T':>4} {'bf16 us':>8} {'fp8 us':>8} {'best us':>8} {'best cfg':24} "
    print(hdr + f"{'floor us':>8} {'own/floor':>9} {'own/bf16':>8} {'best/bf16':>9}")
    for name, n, k, e in projections(args.shape, args.slots, args.rank):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q, scale = quantize_fp8(w)
        q, scale = q.contiguous(), scale.float().reshape(n, 1).contiguous()
        a = torch.randn(e, k, device=dev, dtype=torch.bfloat16) * 0.02
        w_aug = torch.cat([w, a])
        del w
        for t in args.batches:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_aug_linear_torch(x, q, scale, a).float()
            bf16_ms = _time_ms(functools.partial(F.linear, x, w_aug), args.reps)
            own = fp8_linear_config(t, n, k, k)
            fp8 = functools.partial(fp8_aug_linear, x, q, scale, a)
            times = {}
            for cfg in [own] + ([] if args.no_sweep else sweep_configs(own.block_m, k)):
                if cfg in times:
                    continue
                try:
                    got = fp8(config=cfg).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        print(f"  WRONG {name} T={t} {cfg}: relative error {err:.3g}")
                        continue
                    times[cfg] = _time_ms(functools.partial(fp8, config=cfg), args.reps)
                except Exception as ex:  # noqa: BLE001 - out of shared memory etc.
                    print(f"  skip {cfg}: {type(ex).__name__}: {str(ex)[:120]}")
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
        del q, scale, a, w_aug
    print("CONFIGS = {  # (N, K, block_m) -> best of the sweep, summed over the bucket's T")
    for key, agg in best_of.items():
        c = min(agg, key=agg.__getitem__)
        print(f"    {key}: Fp8LinearConfig({c.block_m}, {c.block_n}, {c.block_k}, "
              f"{c.split_k}, {c.num_warps}, {c.num_stages}),")  # fmt: skip
    print("}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": git_commit(), "shape": args.shape, "bandwidth": bw,
                       "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
