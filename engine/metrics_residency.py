"""Adapter residency as metrics: which adapters sit in which tier (GPU slot, CPU tier), what
they cost, how full each tier is, and how often a request found its adapter there.

Names under ``loraplex:``; where the vLLM proposal for residency metrics names an equivalent
(``lora_adapter_loaded``, loaded counts per tier, ``max_gpu_lora_adapters``), that name too.
Built from a plain ``Residency`` (``metrics.read_residency`` is the one place that reads the
adapter registry). Cardinality is bounded: one series per resident version, and residents are
capped by the GPU slots plus the CPU tier.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["ResidentAdapter", "Residency", "residency_families", "TIERS"]

TIERS = ("gpu", "cpu")


@dataclass(frozen=True)
class ResidentAdapter:
    """One adapter version in memory. ``tier``: "gpu" when it holds a GPU slot (it stays in
    the CPU tier too), "cpu" when it is in the CPU tier only."""

    name: str
    digest: str
    tier: str
    pinned: bool
    rank: int  # largest module rank
    nbytes: int  # its LoRA tensors in host memory (what a slot write copies)
    current: bool  # False: a superseded version still finishing its requests


@dataclass(frozen=True)
class Residency:
    """``adapters``: None where the engine lists no versions (the Ray ingress: per replica,
    serve_ray/metrics.py). ``loaded``: adapters per tier (gpu: slot holders; cpu: the whole CPU
    tier, slot holders included). ``capacity``: the most each tier holds (a tier absent: not
    known here). ``counters``: the adapter manager's hit / miss / load / eviction counts."""

    adapters: tuple[ResidentAdapter, ...] | None
    loaded: Mapping[str, int]
    capacity: Mapping[str, int]
    counters: Mapping[str, float] = field(default_factory=dict)


def _per_tier(cls: type, name: str, doc: str, values: Mapping[str, float]) -> Metric:
    family = cls(name, doc, labels=["tier"])
    for tier, v in values.items():
        family.add_metric([tier], v)
    return family


def _one_per_name(adapters: tuple[ResidentAdapter, ...]) -> list[ResidentAdapter]:
    """One version per name for the vLLM-named series (its labels carry no digest): the
    current one if resident, else the one in the highest tier."""
    best: dict[str, ResidentAdapter] = {}
    for a in adapters:
        b = best.get(a.name)
        if b is None or (a.current, a.tier == "gpu") > (b.current, b.tier == "gpu"):
            best[a.name] = a
    return [best[n] for n in sorted(best)]


def residency_families(r: Residency) -> Iterator[Metric]:
    if r.adapters is not None:
        per = GaugeMetricFamily(
            "loraplex:adapter_resident_bytes",
            "Adapter versions in memory, one series each (value: their LoRA tensors' bytes). "
            "tier: gpu (holds a GPU slot, and stays in the CPU tier) or cpu (CPU tier only).",
            labels=["adapter", "digest", "tier", "pinned", "rank"],
        )
        for a in sorted(r.adapters, key=lambda a: (a.name, a.digest)):
            pinned = "true" if a.pinned else "false"
            per.add_metric([a.name, a.digest[:12], a.tier, pinned, str(a.rank)], a.nbytes)
        yield per
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "Loaded LoRA adapters, one series per name while loaded (value 1); level: gpu or cpu.",
            labels=["adapter_name", "level", "pinned", "rank"],
        )
        for a in _one_per_name(r.adapters):
            loaded.add_metric([a.name, a.tier, "true" if a.pinned else "false", str(a.rank)], 1)
        yield loaded
    yield _per_tier(
        GaugeMetricFamily, "loraplex:adapters_loaded",
        "Adapters per tier (gpu: holding a slot; cpu: the CPU tier, slot holders included).",
        {t: r.loaded.get(t, 0) for t in TIERS},
    )  # fmt: skip
    yield _per_tier(
        GaugeMetricFamily, "loraplex:adapter_capacity",
        "The most adapters a tier holds (gpu: --max-loras; cpu: --max-cpu-loras).",
        {t: r.capacity[t] for t in TIERS if t in r.capacity},
    )  # fmt: skip
    for tier in TIERS:
        yield GaugeMetricFamily(
            f"vllm:num_{tier}_loaded_lora_adapters",
            f"LoRA adapters loaded in the {tier.upper()} tier.",
            r.loaded.get(tier, 0),
        )
    if "gpu" in r.capacity:
        yield GaugeMetricFamily(
            "vllm:max_gpu_lora_adapters", "GPU LoRA adapter slots.", r.capacity["gpu"]
        )
    c = r.counters
    gpu_hits, cpu_hits, cold = c.get("gpu_hits", 0), c.get("cpu_hits", 0), c.get("misses", 0)
    yield _per_tier(
        CounterMetricFamily, "loraplex:adapter_hits",
        "Requests whose adapter a tier held when they arrived (cpu: in the CPU tier but in no "
        "GPU slot, so a slot write followed).",
        {"gpu": gpu_hits, "cpu": cpu_hits},
    )  # fmt: skip
    yield _per_tier(
        CounterMetricFamily, "loraplex:adapter_misses",
        "Requests whose adapter a tier did not hold (gpu: in no GPU slot; cpu: in no tier at "
        "all, a cold load).",
        {"gpu": cpu_hits + cold, "cpu": cold},
    )  # fmt: skip
    yield _per_tier(
        CounterMetricFamily, "loraplex:adapter_evictions",
        "Adapters evicted from a tier (gpu: a slot given to another adapter; cpu: tensors "
        "dropped from host memory).",
        {"gpu": c.get("gpu_evictions", 0), "cpu": c.get("cpu_evictions", 0)},
    )  # fmt: skip
