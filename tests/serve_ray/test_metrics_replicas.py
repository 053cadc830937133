"""The Ray ingress's /metrics: the model-server protocol for the whole cluster under vLLM's
names (what a gateway's picker reads of the ingress), and each replica's figures under
``loraplex:replica_*``; parsed with prometheus_client's parser."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.serve_ray.board import Board
from loraplex.engine.serve_ray.metrics import RoutingCollector
from tests.helpers.ray_cluster import Cluster


def _parse(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _by_replica(fams: dict[str, Any], name: str) -> dict[str, Any]:
    return {s.labels["replica"]: s for s in fams[name].samples}


def _report(gpu: list[str], cpu: list[str], running: int, waiting: int, wanted: list[str]):
    stats = {
        "gpu_resident": gpu, "cpu_resident": cpu, "running": running, "waiting": waiting,
        "waiting_adapters": wanted, "num_blocks": 100, "num_used_blocks": 25, "max_loras": 2,
    }  # fmt: skip
    return {"gpu": gpu, "cpu": cpu, "load": running + waiting, "stats": stats}


def test_replica_families_from_the_routing_reports():
    board = Board("metrics-test")
    board.reports["r1"] = _report(["sql"], ["sql", "pirate"], 1, 2, ["sql", "emoji"])
    board.reports["r2"] = _report([], [], 0, 0, [])
    registry = CollectorRegistry()
    registry.register(RoutingCollector(board))
    fams = _parse(generate_latest(registry).decode())

    info = _by_replica(fams, "loraplex:replica_lora_requests_info")
    assert info["r1"].labels == {
        "replica": "r1",
        "max_lora": "2",
        "running_lora_adapters": "sql",
        "waiting_lora_adapters": "emoji",  # sql waits for a seat, not for its adapter: running
    }
    assert info["r2"].labels["running_lora_adapters"] == ""
    assert abs(info["r1"].value - time.time()) < 60
    assert _by_replica(fams, "loraplex:replica_num_requests_waiting")["r1"].value == 2
    assert _by_replica(fams, "loraplex:replica_num_requests_running")["r1"].value == 1
    assert _by_replica(fams, "loraplex:replica_kv_cache_usage_perc")["r1"].value == 0.25
    resident = {
        (s.labels["replica"], s.labels["adapter"]): s.labels["tier"]
        for s in fams["loraplex:replica_adapter_resident"].samples
    }
    assert resident == {("r1", "sql"): "gpu", ("r1", "pirate"): "cpu"}
    # the protocol's own names stay the cluster's (server/app.py's collector), never per replica
    assert not any(name.startswith("vllm:") for name in fams)


def test_ingress_serves_the_protocol_for_the_cluster_and_per_replica(cluster: Cluster):
    cluster.client().completions.create(model="sql", prompt="Hello", max_tokens=2)

    def scrape() -> dict[str, Any]:
        with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=30) as r:
            return _parse(r.read().decode())

    deadline = time.monotonic() + 30
    while True:  # the replicas report their residency every so often
        fams = scrape()
        per = _by_replica(fams, "loraplex:replica_lora_requests_info")
        if any("sql" in s.labels["running_lora_adapters"].split(",") for s in per.values()):
            break
        assert time.monotonic() < deadline, "no replica reported sql in a slot"
        time.sleep(0.2)

    assert set(per) == set(cluster.replicas())
    for s in per.values():
        running = set(filter(None, s.labels["running_lora_adapters"].split(",")))
        waiting = set(filter(None, s.labels["waiting_lora_adapters"].split(",")))
        assert not running & waiting and s.labels["max_lora"] == "4"
    (info,) = fams["vllm:lora_requests_info"].samples  # the cluster: one series
    assert "sql" in info.labels["running_lora_adapters"].split(",")
    assert info.labels["max_lora"] == "8"  # two replicas of four slots
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        (s,) = fams[name].samples
        assert s.labels == {"model_name": cluster.engine.model_name}
    (kv,) = fams["vllm:kv_cache_usage_perc"].samples
    (old,) = fams["vllm:gpu_cache_usage_perc"].samples
    assert 0 <= kv.value <= 1 and kv.value == old.value
    (cache,) = fams["vllm:cache_config_info"].samples
    assert cache.labels["block_size"] == "16"
    counts = {s.labels["tier"]: s.value for s in fams["loraplex:adapters_loaded"].samples}
    assert counts["gpu"] >= 1
