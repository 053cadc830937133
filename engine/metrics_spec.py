"""Speculative decoding's Prometheus families, read from ``engine.stats()["speculative"]`` at
scrape time (spec/control.py counts): tokens proposed and accepted, verified rows by
acceptance length and decoding rows the backoff left without a proposal, per adapter label (bounded as every adapter label: metrics.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

__all__ = ["spec_families"]


def spec_families(s: dict[str, Any], label_of: Callable[[str], str]) -> Iterator[Metric]:
    """The families of engine stats ``s`` (nothing while speculation is off); ``label_of``:
    adapter name ("" for the base model) -> its label value."""
    spec = s.get("speculative")
    if not spec:
        return
    proposed: dict[str, float] = {}
    accepted: dict[str, float] = {}
    backoff: dict[str, float] = {}
    lengths: dict[str, list[int]] = {}
    for name, per in spec["per_adapter"].items():
        label = label_of(name)
        proposed[label] = proposed.get(label, 0) + per["proposed_tokens"]
        accepted[label] = accepted.get(label, 0) + per["accepted_tokens"]
        backoff[label] = backoff.get(label, 0) + per.get("backoff_rows", 0)
        hist = lengths.setdefault(label, [0] * len(per["acceptance_lengths"]))
        for i, n in enumerate(per["acceptance_lengths"]):
            hist[i] += n
    for name, doc, values in (
        ("loraplex:spec_decode_proposed_tokens", "Tokens proposed by speculation.", proposed),
        ("loraplex:spec_decode_accepted_tokens", "Proposed tokens kept by verification.",
         accepted),
        ("loraplex:spec_decode_backoff_rows",
         "Decoding rows left without a proposal: their request's recent acceptance was low.",
         backoff),
    ):  # fmt: skip
        family = CounterMetricFamily(name, doc, labels=["adapter"])
        for label, v in values.items():
            family.add_metric([label], v)
        yield family
    family = HistogramMetricFamily(
        "loraplex:spec_decode_acceptance_length",
        "Verified rows by the number of proposed tokens they kept (0..K).",
        labels=["adapter"],
    )
    for label, hist in lengths.items():
        running, buckets = 0, []
        for i, n in enumerate(hist):
            running += n
            buckets.append((str(i), running))
        buckets.append(("+Inf", running))
        family.add_metric([label], buckets, sum(i * n for i, n in enumerate(hist)))
    yield family
