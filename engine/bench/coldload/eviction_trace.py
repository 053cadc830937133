"""Request traces for the eviction study (eviction_sim.py): adapters with sizes and load costs,
Poisson arrivals, Zipf popularity, stationary or shifting.

Each adapter is 27.3 MB (rank-16 q/k/v/o, Llama-3-8B shape) or, with probability
``large_fraction``, 84 MB (issue 41's two sizes), drawn independently of its popularity. Its
modeled costs: a full load (fetch + verify + preflight + stage) of ``overhead_s + bytes /
load_bps`` times a per-adapter factor in [0.8, 1.25] (the measured spread), and a slot write of
``bytes / write_bps``. Defaults put a 27 MB load at ~180 ms (the issue's 155-207 ms on the H200
host) and a slot write at the study's ~30 GB/s under load.

Workloads: ``zipf`` is stationary (rank k is adapter k for the whole trace); ``shift`` rotates
popularity ``phases - 1`` times: in phase p rank k is adapter ``(k + p * shift) % n``, so the
``shift`` hottest adapters of a phase become the coldest of the next and every other one moves
up: an adapter that was popular stops being used, the case where ageing matters.

Seeded streams (as in workload.py): sizes, costs, arrival times and adapter picks each have
their own, so two traces that differ only in alpha or workload see the same adapters and times.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from loraplex.engine.bench.coldload.workload import zipf_cdf

__all__ = ["WORKLOADS", "AdapterSpec", "Request", "Trace", "TraceConfig", "make_trace"]

WORKLOADS = ("zipf", "shift")
SMALL_BYTES = 27_300_000  # rank 16 on q/k/v/o of a Llama-3-8B shape, bf16
LARGE_BYTES = 84_000_000


@dataclass(frozen=True)
class AdapterSpec:
    nbytes: int
    load_s: float  # a miss in both tiers: fetch + verify + preflight + stage
    write_s: float  # a host hit: the slot write


@dataclass(frozen=True)
class Request:
    t: float  # arrival, seconds from the start
    adapter: int  # index into Trace.adapters
    out_tokens: int  # decode steps it holds its slot for


@dataclass(frozen=True)
class Trace:
    name: str
    adapters: tuple[AdapterSpec, ...]
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class TraceConfig:
    workload: str = "zipf"
    num_adapters: int = 1000
    alpha: float = 1.0
    rate: float = 12.0  # requests / s, base-model ones included
    base_fraction: float = 0.1  # base-model requests (they touch no adapter cache: dropped)
    duration: float = 900.0
    large_fraction: float = 0.25
    phases: int = 4  # (shift)
    shift: int = 100  # (shift) ranks popularity moves per phase
    out_lo: int = 32
    out_hi: int = 128
    overhead_s: float = 0.02
    load_bps: float = 170e6
    write_bps: float = 30e9
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, not {self.workload!r}")
        if self.num_adapters < 1 or self.rate <= 0 or self.duration <= 0 or self.phases < 1:
            raise ValueError("num_adapters, rate, duration and phases must be positive")
        if not 0 <= self.large_fraction <= 1 or not 0 <= self.base_fraction < 1:
            raise ValueError("large_fraction must be in [0, 1] and base_fraction in [0, 1)")
        if not 1 <= self.out_lo <= self.out_hi:
            raise ValueError("want 1 <= out_lo <= out_hi")


def _adapters(c: TraceConfig) -> tuple[AdapterSpec, ...]:
    sizes = random.Random(f"{c.seed}-sizes")
    costs = random.Random(f"{c.seed}-costs")
    out = []
    for _ in range(c.num_adapters):
        nbytes = LARGE_BYTES if sizes.random() < c.large_fraction else SMALL_BYTES
        load = (c.overhead_s + nbytes / c.load_bps) * costs.uniform(0.8, 1.25)
        out.append(AdapterSpec(nbytes, load, nbytes / c.write_bps))
    return tuple(out)


def make_trace(c: TraceConfig) -> Trace:
    """The trace of ``c`` (deterministic in it)."""
    times = random.Random(f"{c.seed}-times")
    picks = random.Random(f"{c.seed}-adapters-{c.alpha}")
    lengths = random.Random(f"{c.seed}-lengths")
    cdf = zipf_cdf(c.num_adapters, c.alpha)
    n = c.num_adapters
    rate = c.rate * (1.0 - c.base_fraction)  # thinning a Poisson stream leaves a Poisson one
    phase_s = c.duration / c.phases if c.workload == "shift" else c.duration
    out: list[Request] = []
    t = 0.0
    while True:
        t += times.expovariate(rate)
        if t >= c.duration:
            break
        rank = min(bisect.bisect_left(cdf, picks.random()), n - 1)
        phase = min(int(t // phase_s), c.phases - 1) if c.workload == "shift" else 0
        out.append(Request(t, (rank + phase * c.shift) % n, lengths.randint(c.out_lo, c.out_hi)))
    label = f"{c.workload} n={n} alpha={c.alpha}"
    return Trace(label, _adapters(c), tuple(out))
