"""The cold-load study's tiny CPU point, shared by its test modules (tests/bench/)."""

from __future__ import annotations

from typing import Any

from loraplex.engine.bench.coldload.config import Lengths, PointConfig

# a study point that runs in seconds on a CPU: tiny random model, a dozen small adapters
FAST = dict(
    synthetic="tiny",
    device="cpu",
    num_adapters=12,
    rank=4,
    prompt_len=Lengths(4, 24),
    output_len=Lengths(3, 10),
    rate=25.0,
    duration=1.2,
    alpha=1.0,
    base_fraction=0.1,
    max_loras=2,
    max_cpu_loras=4,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    drain_timeout=30.0,
)


def point(**kw: Any) -> PointConfig:
    """``FAST`` with ``kw`` over it."""
    return PointConfig(**{**FAST, **kw})
