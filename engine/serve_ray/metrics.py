"""Routing metrics on the ingress's ``/metrics``: per-replica residency and load, where requests
went (their adapter's tier on the chosen replica), and each replica's model-server protocol
figures. Read from the board (the replicas' latest routing reports) at scrape time.

The protocol families under vLLM's names on the ingress describe the whole cluster (the
ingress is the endpoint a gateway's picker sees: server/app.py's collector on the merged
stats); the same figures per replica are here, under ``loraplex:replica_*`` with a ``replica``
label, so that a sum over the scrape never counts a request twice. docs/metrics.md lists them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.engine.metrics_protocol import LORA_INFO_LABELS, ProtocolView
from loraplex.engine.serve_ray.board import Board

__all__ = ["RoutingCollector", "replica_families"]


class RoutingCollector(Collector):
    def __init__(self, board: Board) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        reports, decisions = self.board.snapshot()
        yield GaugeMetricFamily(
            "loraplex_replicas", "Engine replicas reporting residency.", len(reports)
        )
        resident = GaugeMetricFamily(
            "loraplex_replica_adapters_resident",
            "Adapters resident per replica and tier (gpu: in a slot, cpu: in the host tier).",
            labels=["replica", "tier"],
        )
        load = GaugeMetricFamily(
            "loraplex_replica_load", "Running + waiting requests per replica.", labels=["replica"]
        )
        for replica, r in sorted(reports.items()):
            resident.add_metric([replica, "gpu"], len(r.get("gpu", ())))
            resident.add_metric([replica, "cpu"], len(r.get("cpu", ())))
            load.add_metric([replica], r.get("load", 0))
        yield resident
        yield load
        routed = CounterMetricFamily(
            "loraplex_route_decisions",
            "Requests routed, by replica and what that replica held of the request's adapter "
            "(slot: in a GPU slot, cpu: in the host tier, loading: sent there and loading, "
            "miss: nowhere, a cold load; base: no adapter).",
            labels=["replica", "tier"],
        )
        for (replica, tier), n in sorted(decisions.items()):
            routed.add_metric([replica, tier], n)
        yield routed
        yield from replica_families(reports)


def replica_families(
    reports: Mapping[str, Mapping[str, Any]], now: float | None = None
) -> Iterator[Metric]:
    """Each replica's protocol figures and resident adapters (``reports``: replica -> its
    latest routing report, ``replica.routing_stats``)."""
    now = time.time() if now is None else now
    views = {r: ProtocolView.of(rep.get("stats") or {}) for r, rep in sorted(reports.items())}
    gauges = {
        "num_requests_running": ("Requests in the replica's running batch.", "running"),
        "num_requests_waiting": ("Requests waiting on the replica.", "waiting"),
        "kv_cache_usage_perc": ("The replica's KV-cache usage (1 means 100 percent).", "kv_usage"),
    }
    for name, (doc, attr) in gauges.items():
        g = GaugeMetricFamily(f"loraplex:replica_{name}", doc, labels=["replica"])
        for replica, view in views.items():
            g.add_metric([replica], getattr(view, attr))
        yield g
    info = GaugeMetricFamily(
        "loraplex:replica_lora_requests_info",
        "vllm:lora_requests_info of each replica (value: the time of this report).",
        labels=["replica", *LORA_INFO_LABELS],
    )
    for replica, view in views.items():
        info.add_metric([replica, *view.lora_labels()], now)
    yield info
    resident = GaugeMetricFamily(
        "loraplex:replica_adapter_resident",
        "Adapters resident on each replica (value 1): tier gpu (in a GPU slot) or cpu (in the "
        "CPU tier only).",
        labels=["replica", "adapter", "tier"],
    )
    for replica, rep in sorted(reports.items()):
        gpu = set(rep.get("gpu") or ())
        for name in sorted(gpu):
            resident.add_metric([replica, name, "gpu"], 1)
        for name in sorted(set(rep.get("cpu") or ()) - gpu):
            resident.add_metric([replica, name, "cpu"], 1)
    yield resident
