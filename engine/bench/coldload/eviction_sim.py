"""A model of the two adapter tiers for comparing eviction policies on one trace (issue 41).

This is a model, not the engine: it replays a trace (eviction_trace.py) through

- a host tier of ``max_cpu_loras`` entries that holds every GPU-resident adapter (as the
  registry's CPU tier does) and evicts only entries in no slot and not loading;
- ``max_loras`` GPU slots; a slot changes owner only when no request runs on it;
- ``load_lanes`` loads at once (the engine's ``max_concurrent_loads``); a load waits for a
  lane; requests for an adapter being loaded join that load (single-flight).

A request is a GPU hit (its adapter holds a slot), a host hit (in the host tier: it costs the
slot write) or a miss (a full load, then the slot write). It runs ``out_tokens`` steps of
``step_s`` on its slot; its modeled TTFT is the wait for its adapter (load lane, load, a free
slot, slot write) plus one step. Each tier has its own policy instance, touched on every use.

Simplifications: requests are handled in arrival order, and a request that must wait for a
slot takes it (and picks the victim) when it is handled, not when the slot frees; decode steps
do not slow down with load or batch size; load and slot-write costs are fixed per adapter.
Counts depend only on the trace, the sizes and the policies, never on the wall clock.

``python -m loraplex.engine.bench.coldload.eviction_sim --adapters 1000 --alpha 0.8 1.1
--max-loras 8 32 --policies lru lfu gdsf`` prints one markdown table.
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from loraplex.engine.adapters.eviction import POLICIES, EvictionPolicy, make_policy
from loraplex.engine.bench.coldload.eviction_trace import (
    WORKLOADS,
    Trace,
    TraceConfig,
    make_trace,
)

__all__ = ["CacheModel", "SimResult", "simulate", "main"]


@dataclass(frozen=True)
class CacheModel:
    max_loras: int
    max_cpu_loras: int
    load_lanes: int = 2
    step_s: float = 0.006  # ITL p50 of the Zipf study's runs (docs/coldload.md): 5.5-6 ms

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras or self.load_lanes < 1:
            raise ValueError("want 1 <= max_loras <= max_cpu_loras and load_lanes >= 1")


@dataclass
class SimResult:
    policy: str
    requests: int = 0
    gpu_hits: int = 0
    host_hits: int = 0
    misses: int = 0
    load_s: float = 0.0  # modeled seconds of full loads
    write_s: float = 0.0  # modeled seconds of slot writes
    gpu_evictions: int = 0
    host_evictions: int = 0
    ttft: list[float] = field(default_factory=list)

    def share(self, n: int) -> float:
        return n / self.requests if self.requests else 0.0

    def ttft_q(self, q: float) -> float:
        """The q-quantile of the modeled TTFT (nearest rank)."""
        if not self.ttft:
            return math.nan
        xs = sorted(self.ttft)
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def _policies(spec: str) -> tuple[EvictionPolicy, EvictionPolicy]:
    """``NAME`` (both tiers) or ``GPU/HOST``: a policy instance per tier."""
    gpu, _, host = spec.partition("/")
    return make_policy(gpu), make_policy(host or gpu)


def simulate(trace: Trace, model: CacheModel, policy: str) -> SimResult:
    """Replay ``trace`` through ``model`` with ``policy`` (see ``_policies``)."""
    gpu_p, host_p = _policies(policy)
    specs = trace.adapters
    res = SimResult(policy)
    host: dict[int, float] = {}  # adapter -> when its load lands (host tier, in order)
    gpu: dict[int, list[float]] = {}  # adapter -> [write landed at, last request ends at]
    lanes = [0.0] * model.load_lanes  # when each load lane is free (a heap)
    for r in trace.requests:
        a, t, spec = r.adapter, r.t, specs[r.adapter]
        res.requests += 1
        if a in gpu:
            res.gpu_hits += 1
        elif a in host:
            res.host_hits += 1
        else:
            res.misses += 1
            while len(host) >= model.max_cpu_loras:  # room in the host tier
                idle = [k for k, done in host.items() if k not in gpu and done <= t]
                if not idle:
                    break  # over capacity until some entry goes idle (as the registry does)
                gone = host_p.victim(idle, now=t)
                del host[gone]
                res.host_evictions += 1
            start = max(t, heapq.heappop(lanes))
            host[a] = start + spec.load_s
            heapq.heappush(lanes, host[a])
            res.load_s += spec.load_s
        host_p.touch(a, now=t, size=spec.nbytes, cost=spec.load_s)
        if a not in gpu:
            at = max(t, host[a])  # the adapter is in host memory: it wants a slot
            if len(gpu) >= model.max_loras:
                at = max(at, min(e[1] for e in gpu.values()))  # a slot whose requests ended
                idle = [k for k, e in gpu.items() if e[1] <= at]
                gone = gpu_p.victim(idle, now=t)
                del gpu[gone]
                res.gpu_evictions += 1
            gpu[a] = [at + spec.write_s, 0.0]
            res.write_s += spec.write_s
        gpu_p.touch(a, now=t, size=spec.nbytes, cost=spec.write_s)
        entry = gpu[a]
        ready = max(t, entry[0])
        entry[1] = max(entry[1], ready + r.out_tokens * model.step_s)
        res.ttft.append(ready - t + model.step_s)
    return res


def _row(trace: TraceConfig, model: CacheModel, r: SimResult, lru: SimResult | None) -> str:
    p50, p99 = r.ttft_q(0.5) * 1e3, r.ttft_q(0.99) * 1e3
    vs = f"{p99 / (lru.ttft_q(0.99) * 1e3):.2f}" if lru is not None else "-"
    return (
        f"| {trace.workload} | {model.max_loras} | {trace.alpha:g} | {r.policy} "
        f"| {r.share(r.gpu_hits):.1%} | {r.share(r.host_hits):.1%} | {r.share(r.misses):.1%} "
        f"| {r.load_s + r.write_s:.1f} | {p50:.0f} / {p99:.0f} | {vs} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loraplex.engine.bench.coldload.eviction_sim",
        description="Model of the adapter tiers: eviction policies on one trace (not the engine).",
    )
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--alpha", type=float, nargs="+", default=[0.8, 1.1])
    ap.add_argument("--max-loras", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--max-cpu-loras", type=int, default=128)
    ap.add_argument(
        "--policies", nargs="+", default=list(POLICIES), help="NAME or GPU/HOST, of: "
        + ", ".join(POLICIES),
    )  # fmt: skip
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--rate", type=float, default=12.0, help="requests/s (base model included)")
    ap.add_argument("--base-fraction", type=float, default=0.1)
    ap.add_argument("--duration", type=float, default=900.0, help="seconds of arrivals")
    ap.add_argument("--large-fraction", type=float, default=0.25, help="share of 84 MB adapters")
    ap.add_argument("--phases", type=int, default=4, help="(shift) popularity phases")
    ap.add_argument("--shift", type=int, default=100, help="(shift) ranks moved per phase")
    ap.add_argument("--load-lanes", type=int, default=2, help="loads at once")
    ap.add_argument("--step-ms", type=float, default=6.0, help="one decode step")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        for p in a.policies:
            _policies(p)
        models = [
            CacheModel(m, a.max_cpu_loras, a.load_lanes, a.step_ms / 1e3) for m in a.max_loras
        ]
        common = dict(
            num_adapters=a.adapters, rate=a.rate, base_fraction=a.base_fraction,
            duration=a.duration, large_fraction=a.large_fraction, phases=a.phases,
            shift=a.shift, seed=a.seed,
        )  # fmt: skip
        traces = [
            TraceConfig(workload=w, alpha=al, **common) for w in a.workloads for al in a.alpha
        ]
    except ValueError as e:
        ap.error(str(e))
    print(
        "| workload | max_loras | alpha | policy | GPU hit | host hit | miss "
        "| load + write s | TTFT p50 / p99 ms | p99 / lru |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for tc in traces:
        trace = make_trace(tc)
        for model in models:
            lru = simulate(trace, model, "lru")
            for p in a.policies:
                r = lru if p == "lru" else simulate(trace, model, p)
                print(_row(tc, model, r, lru), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
