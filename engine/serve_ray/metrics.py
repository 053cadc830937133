"""Routing metrics on the ingress's ``/metrics``: per-replica residency and load, and where
requests went (their adapter's tier on the chosen replica). Read from the board at scrape time;
each replica keeps its own engine metrics."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.engine.serve_ray.board import Board

__all__ = ["RoutingCollector"]


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
