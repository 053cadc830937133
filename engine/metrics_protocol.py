"""The model-server protocol of the Gateway API Inference Extension: what its endpoint picker
scrapes to score pods (queue depth, KV-cache use, LoRA affinity), under vLLM's metric names,
which are the picker's defaults. docs/metrics.md gives each metric's meaning.

Built from an engine's ``stats()`` dict (``ProtocolView.of``), so that ``loraplex serve`` (one
engine), the Ray ingress (the cluster's merged stats) and its per-replica families (each
replica's routing report) say the same thing the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

__all__ = ["ProtocolView", "protocol_families", "cache_config_family", "LORA_INFO_LABELS"]

LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


@dataclass(frozen=True)
class ProtocolView:
    """What the protocol reports of one engine (or one replica, or a whole cluster).

    ``running_adapters``: adapters holding a GPU slot (the protocol document's "loaded in GPU
    memory and ready to serve requests"), busy or idle. ``waiting_adapters``: adapters that a
    waiting request asks for and that hold no GPU slot (loading, or queued for a slot). The two
    are disjoint by construction: an adapter in a slot whose requests wait for a batch seat is
    running, not waiting (docs/metrics.md says why this meaning and not vLLM's).
    """

    running: int  # requests in the running batch
    waiting: int  # requests queued (for a seat, KV blocks or their adapter)
    kv_usage: float  # fraction of KV blocks referenced by requests, 0..1
    max_lora: int  # GPU adapter slots
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]

    @classmethod
    def of(cls, stats: Mapping[str, Any]) -> ProtocolView:
        """From ``AsyncEngine.stats()`` (or a merge of several, or a replica's report)."""
        in_slot = sorted(set(stats.get("gpu_resident") or ()))
        wanted = set(stats.get("waiting_adapters") or ()) - set(in_slot)
        blocks = int(stats.get("num_blocks") or 0)
        used = int(stats.get("num_used_blocks") or 0)
        return cls(
            running=int(stats.get("running") or 0),
            waiting=int(stats.get("waiting") or 0),
            kv_usage=min(1.0, used / blocks) if blocks > 0 else 0.0,
            max_lora=int(stats.get("max_loras") or 0),
            running_adapters=tuple(in_slot),
            waiting_adapters=tuple(sorted(wanted)),
        )

    def lora_labels(self) -> list[str]:
        """Label values of ``vllm:lora_requests_info``, in ``LORA_INFO_LABELS`` order (the
        picker splits the lists on commas and trims each name)."""
        return [
            str(self.max_lora),
            ",".join(self.running_adapters),
            ",".join(self.waiting_adapters),
        ]


def protocol_families(
    view: ProtocolView, model_name: str, now: float | None = None
) -> Iterator[Metric]:
    """The protocol's gauges under vLLM's names (KV use under both of its names)."""
    for name, doc, value in (
        ("vllm:num_requests_running", "Requests in the running batch.", view.running),
        ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", view.waiting),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: the fraction of KV blocks requests hold (1 means 100 percent).",
            view.kv_usage,
        ),
        (
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage (1 means 100 percent); the older name of vllm:kv_cache_usage_perc, "
            "which the protocol document still names.",
            view.kv_usage,
        ),
    ):
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([model_name], value)
        yield g
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "LoRA adapters (value: the time of this report, so a picker takes the latest). "
        "running_lora_adapters: in a GPU slot, ready; waiting_lora_adapters: asked for by a "
        "waiting request and in no GPU slot; max_lora: GPU adapter slots.",
        labels=list(LORA_INFO_LABELS),
    )
    info.add_metric(view.lora_labels(), time.time() if now is None else now)
    yield info


def cache_config_family(
    block_size: int, num_gpu_blocks: int, enable_prefix_caching: bool | None
) -> Metric:
    """``vllm:cache_config_info``: the KV-cache configuration as labels, value 1 (the picker's
    prefix scorer reads ``block_size``)."""
    labels = {"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks)}
    if enable_prefix_caching is not None:
        labels["enable_prefix_caching"] = str(enable_prefix_caching)
    g = GaugeMetricFamily(
        "vllm:cache_config_info", "KV-cache configuration (value 1).", labels=list(labels)
    )
    g.add_metric(list(labels.values()), 1.0)
    return g
