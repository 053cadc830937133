"""/metrics speaks the model-server protocol of the Gateway API Inference Extension (the names,
types and labels its endpoint picker reads) and reports adapter residency, checked with
prometheus_client's parser on a scripted run: one GPU slot, a long request on ``sql`` running,
a cold request on ``poem`` waiting for that slot, then ``poem`` taking it (an eviction); and
docs/metrics.md names every family."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.serve_ray.board import Board
from loraplex.engine.serve_ray.metrics import RoutingCollector
from tests.helpers.engine import evict_all_cpu
from tests.helpers.server import BASE, serve

Families = dict[str, Any]


async def _scrape(url: str) -> Families:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


def _one(fams: Families, name: str, kind: str) -> Any:
    """The single sample of gauge family ``name`` (its type checked)."""
    fam = fams[name]
    assert fam.type == kind, (name, fam.type)
    (sample,) = fam.samples
    return sample


def _lora(fams: Families) -> tuple[dict[str, str], float]:
    s = _one(fams, "vllm:lora_requests_info", "gauge")
    assert set(s.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    return s.labels, s.value


def _names(csv: str) -> list[str]:
    """As the picker reads a list label: split on commas, names trimmed, empties dropped."""
    return [n.strip() for n in csv.split(",") if n.strip()]


def _per_tier(fams: Families, name: str, suffix: str = "") -> dict[str, float]:
    return {s.labels["tier"]: s.value for s in fams[name].samples if s.name == name + suffix}


def _check_protocol(fams: Families) -> None:
    """Every protocol family: type, labels, and the semantics that hold at any time."""
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        s = _one(fams, name, "gauge")
        assert s.labels == {"model_name": BASE} and s.value >= 0 and s.value == int(s.value)
    kv = _one(fams, "vllm:kv_cache_usage_perc", "gauge")
    old = _one(fams, "vllm:gpu_cache_usage_perc", "gauge")
    assert kv.labels == old.labels == {"model_name": BASE}
    assert 0.0 <= kv.value <= 1.0 and old.value == kv.value  # a fraction, under both names
    labels, stamp = _lora(fams)
    assert labels["max_lora"] == "1"
    assert abs(stamp - time.time()) < 120  # value: a unix timestamp (the picker takes the max)
    running, waiting = (
        _names(labels["running_lora_adapters"]),
        _names(labels["waiting_lora_adapters"]),
    )
    assert not set(running) & set(waiting), labels  # never both
    assert len(running) <= int(labels["max_lora"])
    cache = _one(fams, "vllm:cache_config_info", "gauge")
    assert cache.value == 1 and cache.labels["block_size"] == "4"
    assert int(cache.labels["num_gpu_blocks"]) > 0


async def _wait_for(url: str, pred, what: str, timeout: float = 60.0) -> Families:
    deadline = time.monotonic() + timeout
    while True:
        fams = await _scrape(url)
        _check_protocol(fams)
        if pred(fams):
            return fams
        assert time.monotonic() < deadline, f"never saw {what}"
        await asyncio.sleep(0.005)


async def test_protocol_and_residency_on_a_scripted_run(tiny):
    async for srv in serve(tiny, max_loras=1, max_cpu_loras=1):
        evict_all_cpu(srv.engine)  # the image add_adapter kept: the run starts cold
        client = srv.client()
        fams = await _scrape(srv.url)
        _check_protocol(fams)
        labels, _ = _lora(fams)
        assert _names(labels["running_lora_adapters"]) == []  # nothing loaded yet
        assert _one(fams, "vllm:max_gpu_lora_adapters", "gauge").value == 1

        # sql: cold, then running for many tokens (ignore_eos), holding the only slot
        long = asyncio.create_task(
            client.completions.create(
                model="sql", prompt=[5, 6, 7], max_tokens=480, extra_body={"ignore_eos": True}
            )
        )

        def sql_running(f: Families) -> bool:
            lab, _ = _lora(f)
            busy = _one(f, "vllm:num_requests_running", "gauge").value == 1
            return busy and _names(lab["running_lora_adapters"]) == ["sql"]

        fams = await _wait_for(srv.url, sql_running, "sql running")
        assert _one(fams, "vllm:kv_cache_usage_perc", "gauge").value > 0  # its blocks

        # poem: cold too; it waits (loading, then for the slot sql's request holds)
        short = asyncio.create_task(
            client.completions.create(model="poem", prompt=[8, 9], max_tokens=2)
        )

        def both(f: Families) -> bool:
            lab, _ = _lora(f)
            return (
                _names(lab["running_lora_adapters"]) == ["sql"]
                and _names(lab["waiting_lora_adapters"]) == ["poem"]
                and _one(f, "vllm:num_requests_waiting", "gauge").value == 1
                and _one(f, "vllm:num_requests_running", "gauge").value == 1
            )

        fams = await _wait_for(srv.url, both, "sql running while poem waits")
        loaded = {
            s.labels["adapter_name"]: s.labels for s in fams["vllm:lora_adapter_loaded"].samples
        }
        assert loaded["sql"]["level"] == "gpu"
        assert loaded.get("poem", {}).get("level") in (None, "cpu")  # loading, or loaded
        assert not long.done()

        await asyncio.gather(long, short)
        fams = await _scrape(srv.url)
        _check_protocol(fams)
        labels, _ = _lora(fams)
        # poem took the slot: sql was evicted from it, then from the one-adapter CPU tier
        assert _names(labels["running_lora_adapters"]) == ["poem"]
        assert _names(labels["waiting_lora_adapters"]) == []
        assert _one(fams, "vllm:num_requests_running", "gauge").value == 0
        assert _one(fams, "vllm:num_requests_waiting", "gauge").value == 0
        assert _one(fams, "vllm:kv_cache_usage_perc", "gauge").value == 0

        _check_residency(fams, srv)


def _check_residency(fams: Families, srv) -> None:
    """After the run: poem in the slot, sql gone, two cold loads, one eviction per tier."""
    (poem,) = fams["loraplex:adapter_resident_bytes"].samples
    v = srv.engine.testing.adapters.registry.get("poem")
    assert poem.labels == {
        "adapter": "poem",
        "digest": v.digest[:12],
        "tier": "gpu",
        "pinned": "false",
        "rank": "8",
    }
    assert poem.value == v.adapter.nbytes > 0
    (loaded,) = fams["vllm:lora_adapter_loaded"].samples
    assert loaded.labels == {"adapter_name": "poem", "level": "gpu", "pinned": "false", "rank": "8"}
    assert loaded.value == 1

    assert _per_tier(fams, "loraplex:adapters_loaded") == {"gpu": 1, "cpu": 1}
    assert _per_tier(fams, "loraplex:adapter_capacity") == {"gpu": 1, "cpu": 1}
    for tier in ("gpu", "cpu"):
        assert _one(fams, f"vllm:num_{tier}_loaded_lora_adapters", "gauge").value == 1
    assert _per_tier(fams, "loraplex:adapter_misses", "_total") == {"gpu": 2, "cpu": 2}
    assert _per_tier(fams, "loraplex:adapter_hits", "_total") == {"gpu": 0, "cpu": 0}
    # cpu: the run's one, and the test's evict_all_cpu of the image add_adapter had kept
    assert _per_tier(fams, "loraplex:adapter_evictions", "_total") == {"gpu": 1, "cpu": 2}
    assert fams["loraplex:adapter_misses"].type == "counter"

    stages = {
        s.labels["stage"]: s.value
        for s in fams["loraplex:adapter_load_seconds"].samples
        if s.name.endswith("_count")
    }
    assert stages["total"] == 2 and stages["h2d"] == 2  # two cold loads, two slot writes
    assert fams["loraplex:adapter_load_seconds"].type == "histogram"
    vllm_load = fams["vllm:lora_adapter_load_seconds"]
    assert vllm_load.type == "histogram"
    (count,) = [s for s in vllm_load.samples if s.name.endswith("_count")]
    assert count.value == 2
    # the names from before stay
    assert _per_tier(fams, "loraplex_adapters_resident") == {"gpu": 1, "cpu": 1}
    assert "loraplex_adapter_load_stage_seconds" in fams


async def test_docs_list_every_metric(server):
    """docs/metrics.md names every family loraplex serve and the Ray ingress export."""
    await server.client().completions.create(model="sql", prompt=[5, 6], max_tokens=2)
    names = set(await _scrape(server.url))
    registry = CollectorRegistry()
    board = Board("docs-test")
    board.reports["r1"] = {"gpu": ["sql"], "cpu": ["sql"], "load": 0, "stats": {}}
    board.decisions[("r1", "miss")] = 1
    registry.register(RoutingCollector(board))
    names |= {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {"vllm:lora_requests_info", "loraplex:replica_lora_requests_info"} <= names
    page = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    missing = sorted(n for n in names if not n.endswith("_created") and f"`{n}`" not in page)
    assert not missing, f"docs/metrics.md does not name {missing}"
