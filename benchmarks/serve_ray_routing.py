"""Routing on Ray Serve: adapter residency against random and least-loaded, 2 CPU replicas.

    python -m benchmarks.serve_ray_routing                         # the table (~15 min, 2 cores)
    python -m benchmarks.serve_ray_routing --append BENCHMARKS.md  # ... and append it
    python -m benchmarks.serve_ray_routing --smoke                 # a short run: checks the script

Setup: a local Ray cluster (127.0.0.1), ``--replicas`` engine replicas of the built-in demo
model on CPU, each with ``--slots`` adapter slots and ``--cpu-tier`` places in its CPU tier,
and ``--adapters`` distinct adapters (rank ``--rank`` on every projection, seeded random
weights, written once to a temporary folder, registered on every replica). For each Zipf alpha and
routing policy the replicas are deployed afresh (cold), then ``--requests`` requests arrive
open-loop (Poisson, ``--rate`` per second; adapter ranks drawn Zipf(alpha), the same sequence
for every policy), each a 16-token random prompt and ``--new`` greedy tokens, sent through the
ingress's ``ClusterEngine`` (the HTTP server's engine), after a short warm-up on the base
model. ``--repeats`` runs per (alpha, policy), the policy order reversed on every other one,
are pooled into one row.

Figures: slot-hit rate = requests whose adapter sat in a slot of the replica that ran it
(the engines' own counters), CPU-tier hits likewise, cold loads per request = requests whose
adapter was resident in neither tier there (a fetch + parse + slot write), TTFT = arrival to
first token at the ingress (p50 / p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import save_file

from benchmarks.record import append_cpu_record
from loraplex.engine.demo import demo_adapters

POLICIES = ("residency", "least_loaded", "random")


def _shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of the base model."""
    c = json.loads((model_dir / "config.json").read_text())
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = h // c["num_attention_heads"] * c.get("num_key_value_heads", c["num_attention_heads"])
    attn = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    return {**attn, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def make_adapters(out: Path, n: int, rank: int) -> list[tuple[str, str, None]]:
    """``n`` distinct PEFT adapters of ``rank`` on every projection of the demo model
    (seeded random A and B; the demo adapters' config with r, alpha and targets changed)."""
    from loraplex.engine.demo import demo_model_dir

    model_dir = demo_model_dir()
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    shapes = _shapes(model_dir)
    template = json.loads(
        (next(iter(demo_adapters().values())) / "adapter_config.json").read_text()
    )
    config = {**template, "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes)}
    modules = []
    for a in range(n):
        gen = torch.Generator().manual_seed(1000 + a)
        tensors = {}
        for layer in range(layers):
            for proj, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{key}.lora_A.weight"] = 0.05 * torch.randn(rank, fan_in, generator=gen)
                tensors[f"{key}.lora_B.weight"] = 0.05 * torch.randn(fan_out, rank, generator=gen)
        dst = out / f"z{a:03d}"
        dst.mkdir(parents=True)
        (dst / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, dst / "adapter_model.safetensors")
        modules.append((f"z{a:03d}", str(dst), None))
    return modules


def workload(
    n: int, adapters: int, alpha: float, rate: float, seed: int
) -> list[tuple[float, str]]:
    """(arrival offset s, adapter) of each request; ranks Zipf(alpha), adapter order shuffled."""
    rng = random.Random(seed)
    names = [f"z{i:03d}" for i in range(adapters)]
    rng.shuffle(names)  # popularity is not the registration order
    weights = [1 / (k + 1) ** alpha for k in range(adapters)]
    t, out = 0.0, []
    for name in rng.choices(names, weights, k=n):
        t += rng.expovariate(rate)
        out.append((t, name))
    return out


async def _adapter_counters(handle: Any, replicas: list[str]) -> dict[str, int]:
    total: dict[str, int] = {}
    for r in replicas:
        stats = await handle.stats.remote(replica=r)
        for k, v in stats["adapters"].items():
            total[k] = total.get(k, 0) + int(v)
        total["requests"] = total.get("requests", 0) + int(stats.get("requests", 0))
    return total


async def _drain(gen: Any) -> None:
    async for _ in gen:
        pass


async def run_policy(
    handle: Any, board: Any, policy: str, requests: list[tuple[float, str]], new: int
) -> dict[str, Any]:
    from loraplex.engine import SamplingParams
    from loraplex.engine.serve_ray.cluster_engine import ClusterEngine

    async with ClusterEngine(handle, board) as engine:
        for _ in range(300):  # every replica has reported its residency
            if len(board.snapshot()[0]) >= 2:
                break
            await asyncio.sleep(0.1)
        replicas = sorted(board.snapshot()[0])
        board.set_policy(policy)
        rng = random.Random(5)
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        # warm-up on the base model (a fresh replica's first steps are slower)
        warm = [engine.generate([rng.randrange(10, 500) for _ in range(16)], params, None)
                for _ in range(4 * len(replicas))]  # fmt: skip
        for _ in range(2):
            await asyncio.gather(*(_drain(g) for g in warm))
            warm = [engine.generate([1, 2, 3], params, None) for _ in range(4 * len(replicas))]
        before = await _adapter_counters(handle, replicas)
        _, decisions_before = board.snapshot()
        ttfts: list[float] = []
        by_tier: dict[str, list[float]] = {}

        async def one(i: int, at: float, name: str, t0: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            prompt = [rng.randrange(10, 500) for _ in range(16)]
            start = time.perf_counter()
            first = None
            async for out in engine.generate(prompt, params, name, f"{policy}-{i}"):
                if first is None and out.token_ids:
                    first = time.perf_counter() - start
            ttfts.append(first if first is not None else float("nan"))
            route = board.route_of(f"{policy}-{i}")
            by_tier.setdefault(route[1] if route else "?", []).append(first or float("nan"))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, at, name, t0) for i, (at, name) in enumerate(requests)))
        wall = time.perf_counter() - t0
        after = await _adapter_counters(handle, replicas)
        _, decisions = board.snapshot()
        decisions.subtract(decisions_before)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("gpu_hits", "cpu_hits", "misses")}
    tiers: dict[str, int] = {}
    per_replica: dict[str, int] = {}
    for (replica, tier), count in decisions.items():
        if count:
            tiers[tier] = tiers.get(tier, 0) + count
            per_replica[replica] = per_replica.get(replica, 0) + count
    tier_p50 = {t: round(1000 * statistics.median(v), 1) for t, v in sorted(by_tier.items())}
    return {"policy": policy, "n": len(requests), "ttfts": ttfts, "wall_s": wall, **d,
            "routed": tiers, "ttft_p50_ms_by_tier": tier_p50,
            "requests_per_replica": sorted(per_replica.values(), reverse=True)}  # fmt: skip


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the repeats of one (alpha, policy): counts summed, TTFTs pooled."""
    n = sum(r["n"] for r in runs)
    ttfts = sorted(t for r in runs for t in r["ttfts"])
    q = statistics.quantiles(ttfts, n=100, method="inclusive")
    return {
        "policy": runs[0]["policy"],
        "slot_hit": sum(r["gpu_hits"] for r in runs) / n,
        "cpu_hit": sum(r["cpu_hits"] for r in runs) / n,
        "cold_per_request": sum(r["misses"] for r in runs) / n,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * q[98],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| Zipf alpha | routing | slot-hit rate | CPU-tier hits | cold loads / request "
        "| TTFT p50 (ms) | TTFT p99 (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['alpha']} | {r['policy']} | {100 * r['slot_hit']:.1f} % | "
            f"{100 * r['cpu_hit']:.1f} % | {r['cold_per_request']:.3f} | "
            f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--rank", type=int, default=64, help="adapter rank (every projection)")
    ap.add_argument("--slots", type=int, default=8, help="adapter slots per replica")
    ap.add_argument("--cpu-tier", type=int, default=16, help="CPU-tier adapters per replica")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.8, 1.1])
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second (Poisson)")
    ap.add_argument("--new", type=int, default=8, help="tokens per request")
    ap.add_argument("--max-imbalance", type=int, default=8, help="residency's imbalance bound")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--repeats", type=int, default=2, help="runs per (alpha, policy), pooled")
    ap.add_argument("--smoke", action="store_true", help="24 adapters, 60 requests, one alpha")
    ap.add_argument("--append", type=Path, help="append the table to this markdown file")
    args = ap.parse_args()
    if args.smoke:
        args.adapters, args.requests, args.alphas, args.repeats = 24, 60, [1.1], 1
    logging.basicConfig(level=logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    from loraplex.engine import EngineConfig
    from loraplex.engine.serve_ray.cluster import LocalRay, board_of, deploy, undeploy
    from loraplex.engine.serve_ray.replica import ReplicaSpec

    tmp = Path(tempfile.mkdtemp(prefix="lpx-route-bench-"))
    ray_cluster = LocalRay.start(num_cpus=max(os.cpu_count() or 1, args.replicas))
    rows = []
    try:
        modules = tuple(make_adapters(tmp / "adapters", args.adapters, args.rank))
        config = EngineConfig(
            model=None, device="cpu", served_model_name="demo", max_loras=args.slots,
            max_cpu_loras=args.cpu_tier, max_num_seqs=32, max_lora_rank=args.rank,
        )  # fmt: skip
        spec = ReplicaSpec(config, modules)
        for alpha in args.alphas:
            requests = workload(args.requests, args.adapters, alpha, args.rate, args.seed)
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.policies}
            for rep in range(args.repeats):
                # odd repeats run the policies in reverse: drift of the machine's load is shared
                for policy in args.policies[:: 1 if rep % 2 == 0 else -1]:
                    handle = deploy(
                        spec, replicas=args.replicas, policy=policy,
                        max_imbalance=args.max_imbalance,
                    )  # fmt: skip
                    run = asyncio.run(run_policy(handle, board_of(), policy, requests, args.new))
                    undeploy()
                    runs[policy].append(run)
                    brief = {k: v for k, v in run.items() if k != "ttfts"}
                    print(json.dumps({"alpha": alpha, "repeat": rep, **brief}), flush=True)
            for policy in args.policies:
                rows.append({"alpha": alpha, **pooled(runs[policy])})
    finally:
        ray_cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    text = table(rows)
    print(text)
    if args.append:
        command = "python -m benchmarks.serve_ray_routing" + (" --smoke" if args.smoke else "")
        if args.max_imbalance != 8:
            command += f" --max-imbalance {args.max_imbalance}"
        if args.policies != list(POLICIES):
            command += " --policies " + " ".join(args.policies)
        note = (
            f"{args.replicas} replicas of the demo model on CPU (one core each), "
            f"{args.slots} slots + {args.cpu_tier} CPU-tier places per replica, "
            f"{args.adapters} adapters (rank {args.rank}, every projection), {args.requests} requests per run at {args.rate:g}/s "
            f"(Poisson), 16-token prompts, {args.new} tokens each; replicas deployed afresh "
            f"per run, {args.repeats} runs per row (policy order reversed on every other "
            "run), pooled; hits and cold loads from the engines' counters, TTFT at the "
            f"ingress; load average at the end: {os.getloadavg()[0]:.1f}"
        )
        append_cpu_record(str(args.append), command, text, 1, note)


if __name__ == "__main__":
    main()
