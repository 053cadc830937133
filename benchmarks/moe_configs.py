"""Launch configurations of the MoE decode kernels: the expert LoRA delta
(moe/triton_expert_lora.py) and the base grouped expert GEMM (moe/triton_grouped.py).

A Qwen3-30B-A3B-shaped sparse layer (H 2048, I 768, 128 experts, top 8). ``gate_up`` /
``down``: the expert LoRA delta with 8 slots of rank 16 on every expert, rows spread over the
slots: the two launches (shrink, expand) of ``expert_lora_triton`` for a grid of
``ExpertLoRAConfig``s (the shrink's tiles first with the expand's default, then the expand's
with the best shrink). ``base_gate_up`` / ``base_down``: the grouped GEMM over the routed
experts' weights for a grid of ``GroupedConfig``s. Each case is timed with CUDA events around
a CUDA graph (as a step replays its launches; eager, a decode-sized launch times the host) of
launches over layers whose weights rotate (no layer's weights stay in L2: as in a step), every
config checked against the torch twin first, and prints its best against the launch table's
pick for the device (the rule in use) and the bytes the launches must read (each distinct
(slot, routed expert) A and B block once; the routed experts' weights once).

    python -m benchmarks.moe_configs              # a GPU: ~4 min (Triton compiles)
    python -m benchmarks.moe_configs --smoke      # CPU, TRITON_INTERPRET: the script

The sm_90 rows of both tables came from this script (BENCHMARKS.md, "Mixture of experts");
the 8-32 stream batches settle where the expert LoRA's rows switch.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import replace

import torch

__all__ = ["main"]

SHAPE = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}
SMOKE_SHAPE = {"hidden": 64, "inter": 32, "experts": 8, "top_k": 2}
SHRINK_GRID = {"block_c": (16, 32), "block_k": (64, 128, 256), "num_warps": (4, 8),
               "num_stages": (2, 3, 4)}  # fmt: skip
EXPAND_GRID = {"block_n": (32, 64, 128, 256), "num_warps": (2, 4, 8), "num_stages": (2, 3)}
GROUPED_GRID = {"block_n": (32, 64, 128), "block_k": (64, 128, 256), "num_warps": (4, 8),
                "num_stages": (2, 3, 4)}  # fmt: skip
MODULES = ("gate_up", "down", "base_gate_up", "base_down")


def _grid(base, grid: dict[str, tuple]) -> list:
    keys = list(grid)
    return [
        replace(base, **dict(zip(keys, v, strict=True))) for v in itertools.product(*grid.values())
    ]


def case_tensors(module: str, batch: int, slots: int, rank: int, shape: dict, layers: int,
                 device: str, dtype: torch.dtype, seed: int = 0) -> dict:  # fmt: skip
    """One case's inputs: ``layers`` copies of the slot buffers (rotated over, so that no
    layer's weights are still in L2), the routed pairs and their blocks (as a step sorts
    them), the rows' slots (every row on an adapter, spread over the slots)."""
    from loraplex.engine.model.moe.grouped_gemm import block_m_for
    from loraplex.engine.model.moe.pairs import sort_pairs

    g = torch.Generator(device="cpu").manual_seed(seed)  # routing, inputs
    gd = torch.Generator(device=device).manual_seed(seed)  # weights, drawn where they live
    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    gate_up = module.endswith("gate_up")
    d_in, cols, n = (h, 2 * rank, 2 * i) if gate_up else (i, rank, h)
    p = batch * k
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(batch)]).reshape(-1)
    experts = experts.to(torch.int32).to(device)
    token_slots = (torch.arange(batch, dtype=torch.int32) % slots).to(device)
    x = torch.randn(batch if gate_up else p, d_in, generator=g).to(dtype).to(device)
    blocks = sort_pairs(experts, e, block_m_for(p, e), triton=True)
    out = torch.zeros(p, n, dtype=dtype, device=device)
    elem = torch.tensor([], dtype=dtype).element_size()
    common = {"x": x, "blocks": blocks, "experts": experts, "out": out,
              "a_div": k if gate_up else 1, "top_k": k}  # fmt: skip
    if module.startswith("base_"):  # the routed experts' (N, K) weights
        ws = [(torch.randn(e, n, d_in, generator=gd, device=device) * d_in**-0.5).to(dtype)
              for _ in range(layers)]  # fmt: skip
        used = len(set(experts.tolist()))
        return {**common, "weights": ws, "bytes": used * n * d_in * elem, "base": True}
    weights = []
    for _ in range(layers):
        a = torch.randn(slots, e, cols, d_in, generator=gd, device=device) * d_in**-0.5
        b = torch.randn(slots, e, rank, n, generator=gd, device=device) * 0.01
        a, b = a.to(dtype), b.to(dtype)
        weights.append((a, b))
    ranks = torch.full((slots,), rank, dtype=torch.int32, device=device)
    pairs_used = {(int(s), int(x_)) for s, x_ in zip(
        token_slots.repeat_interleave(k).tolist(), experts.tolist(), strict=True)}  # fmt: skip
    nbytes = len(pairs_used) * (cols * d_in + rank * n) * elem
    return {**common, "weights": weights, "token_slots": token_slots, "ranks": ranks,
            "bytes": nbytes, "base": False}  # fmt: skip


def launch(case: dict, weights, out: torch.Tensor, cfg) -> None:
    """The case's Triton launches under ``cfg`` on one layer copy's ``weights``, into ``out``."""
    if case["base"]:
        from loraplex.engine.model.moe.triton_grouped import grouped_gemm_triton

        grouped_gemm_triton(case["x"], weights, case["blocks"], out, a_div=case["a_div"],
                            config=cfg)  # fmt: skip
        return
    from loraplex.engine.model.moe.triton_expert_lora import expert_lora_triton

    a, b = weights
    expert_lora_triton(case["x"], a, b, case["blocks"], case["token_slots"], case["ranks"], out,
                       a_div=case["a_div"], top_k=case["top_k"], config=cfg)  # fmt: skip


def reference(case: dict) -> torch.Tensor:
    """The torch twin's result on the first layer copy."""
    ref = torch.zeros_like(case["out"])
    if case["base"]:
        from loraplex.engine.model.moe.grouped_gemm import grouped_gemm_torch

        grouped_gemm_torch(case["x"], case["weights"][0], case["experts"], ref,
                           a_div=case["a_div"])  # fmt: skip
        return ref
    from loraplex.engine.model.moe.expert_lora import expert_lora_delta_torch

    a, b = case["weights"][0]
    expert_lora_delta_torch(case["x"], a, b, case["experts"], case["token_slots"], case["ranks"],
                            ref, a_div=case["a_div"], top_k=case["top_k"])  # fmt: skip
    return ref


def check_config(case: dict, cfg) -> float:
    """Largest |difference| of the launches' result under ``cfg`` from the torch twin's, on
    the first layer copy (relative to the twin's largest magnitude): a config that computes
    something else is no candidate."""
    if "ref" not in case:
        case["ref"] = reference(case)
    ref = case["ref"]
    got = torch.zeros_like(case["out"])
    launch(case, case["weights"][0], got, cfg)
    scale = ref.float().abs().max().clamp_min(1e-30)
    return float((got.float() - ref.float()).abs().max() / scale)


def time_config(case: dict, cfg, reps: int, device: str) -> float:
    """Seconds per call on the device: a CUDA graph of one call per layer copy, replayed as a
    step replays its launches (``graph_timing.graph_us``; timed eagerly, a decode-sized launch
    would measure the host's launch cost instead)."""
    for w in case["weights"]:  # compile, warm
        launch(case, w, case["out"], cfg)
    if device != "cuda":
        return float("nan")
    from benchmarks.graph_timing import graph_us

    def layers() -> None:
        for w in case["weights"]:
            launch(case, w, case["out"], cfg)

    return graph_us(layers, rep=reps) * 1e-6 / len(case["weights"])


def candidates(case: dict, in_use) -> list[list]:
    """The grids to walk in order (each after the best of the one before): the base GEMM's one
    grid; the LoRA delta's shrink tiles, then its expand tiles."""
    if case["base"]:
        return [_grid(in_use, GROUPED_GRID)]
    return [_grid(in_use, SHRINK_GRID), EXPAND_GRID]


def run(args: argparse.Namespace) -> list[str]:
    from benchmarks.floor import copy_bandwidth
    from benchmarks.record import git_commit
    from loraplex.engine.model.moe.triton_expert_lora import expert_lora_config
    from loraplex.engine.model.moe.triton_grouped import grouped_config

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    bw = copy_bandwidth()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [
        f"## MoE decode launches: {name}, commit {git_commit()}, copy {bw / 1e12:.2f} TB/s, "
        f"`python -m benchmarks.moe_configs {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        "| kernel | streams | pairs | bytes MB | floor us | in use us | best us | best / floor "
        "| best config |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for module, batch in itertools.product(args.modules, args.batches):
        case = case_tensors(module, batch, args.slots, args.rank, shape, args.layers, device,
                            dtype)  # fmt: skip
        block_m, pairs = case["blocks"].block_m, case["out"].shape[0]
        if case["base"]:
            w = case["weights"][0]
            in_use = grouped_config(block_m, w.shape[1], w.shape[2], w.element_size(), device,
                                     pairs)  # fmt: skip
        else:
            in_use = expert_lora_config(block_m, case["weights"][0][0].shape[2], device, pairs)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        if check_config(case, in_use) > tol:
            raise RuntimeError(f"{module}: the launch in use differs from the torch twin")
        t_in_use = time_config(case, in_use, args.reps, device)
        best, t_best, wrong = in_use, t_in_use, 0
        for grid in candidates(case, in_use) if not args.smoke else []:
            configs = grid if not isinstance(grid, dict) else _grid(best, grid)
            for cfg in configs:
                if cfg.smem_bytes(block_m) > args.smem_kb * 1024:
                    continue
                if check_config(case, cfg) > tol:
                    wrong += 1
                    continue
                t = time_config(case, cfg, args.reps, device)
                if t < t_best:
                    best, t_best = cfg, t
        floor = case["bytes"] / bw
        cfg_text = ", ".join(f"{k} {v}" for k, v in vars(best).items())
        lines.append(
            f"| {module} | {batch} | {case['out'].shape[0]} | {case['bytes'] / 1e6:.1f} | "
            f"{floor * 1e6:.1f} | {t_in_use * 1e6:.1f} | {t_best * 1e6:.1f} | "
            f"{t_best / floor:.2f} | {cfg_text} (block_m {block_m}) |"
            + (f" {wrong} configs differed from the twin: skipped" if wrong else "")
        )
        print(lines[-1], flush=True)
        del case
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET)")
    ap.add_argument("--modules", nargs="+", default=list(MODULES), choices=MODULES)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=6, help="weight copies rotated over")
    ap.add_argument("--reps", type=int, default=20, help="ms of graph replays per config")
    ap.add_argument("--smem-kb", type=int, default=200, help="configs above this are skipped")
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.batches = [b for b in args.batches if b <= 4] or [2]
        args.layers, args.reps = 1, 1
    lines = run(args)
    print("\n".join(lines), flush=True)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
