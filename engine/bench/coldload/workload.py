"""The open-loop workload: Poisson arrivals, Zipf adapter popularity, prompt/output lengths.

Arrival times, adapter choices and lengths come from separate seeded streams, so points that
differ only in the engine (or in alpha) see the same arrival times and lengths.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass

from loraplex.engine.bench.coldload.config import PointConfig

__all__ = ["Arrival", "zipf_cdf", "make_arrivals"]


@dataclass(frozen=True)
class Arrival:
    index: int
    t: float  # seconds after the start of the measurement
    adapter: str | None  # None: the base model
    prompt: list[int]
    max_tokens: int


def zipf_cdf(n: int, alpha: float) -> list[float]:
    """Cumulative Zipf(alpha) probabilities over ranks 1..n (rank 1 most popular)."""
    weights = [k**-alpha for k in range(1, n + 1)]
    total = sum(weights)
    return [c / total for c in itertools.accumulate(weights)]


def make_arrivals(point: PointConfig, names: list[str], vocab_size: int) -> list[Arrival]:
    """Arrivals in ``[0, duration)``; ``names[k]`` is the adapter of popularity rank k+1."""
    times = random.Random(f"{point.seed}-times")
    picks = random.Random(f"{point.seed}-adapters-{point.alpha}-{point.base_fraction}")
    sizes = random.Random(f"{point.seed}-lengths")
    cdf = zipf_cdf(len(names), point.alpha)
    lo_tok = min(16, vocab_size // 2)  # stay clear of special ids at the bottom of the vocab
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += times.expovariate(point.rate)
        if t >= point.duration:
            return out
        if picks.random() < point.base_fraction:
            adapter = None
        else:
            adapter = names[min(bisect.bisect_left(cdf, picks.random()), len(names) - 1)]
        n_prompt = sizes.randint(point.prompt_len.lo, point.prompt_len.hi)
        n_out = sizes.randint(point.output_len.lo, point.output_len.hi)
        prompt = [sizes.randrange(lo_tok, vocab_size) for _ in range(n_prompt)]
        out.append(Arrival(len(out), t, adapter, prompt, n_out))
