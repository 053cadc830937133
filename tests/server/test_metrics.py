"""/metrics: Prometheus text from an own registry, vLLM's LoRA gauge, bounded adapter labels."""

from __future__ import annotations

import aiohttp
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine.metrics import OTHER_LABEL, AdapterLabels, Metrics
from tests.helpers.engine import evict_all_cpu
from tests.helpers.server import BASE


async def _scrape(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


def _samples(family, name: str | None = None) -> list:
    return [s for s in family.samples if name is None or s.name == name]


async def test_metrics_after_requests(server, tiny):
    # an adapter added while the metrics follow the engine: add_adapter's pass is a load
    # (fetch, verify, stage) when the CPU tier has room for its image (the fixture's adapters,
    # added before the app existed, filled it: their images go first)
    evict_all_cpu(server.engine)
    await server.engine.add_adapter("late", f"file://{tiny.adapters['sql']}")
    client = server.client()
    for model in ("sql", "poem", BASE, "sql"):
        await client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=3)
    fams = await _scrape(server.url)

    (info,) = _samples(fams["vllm:lora_requests_info"])
    assert set(info.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert info.labels["max_lora"] == "2" and info.value > 1e9  # a unix timestamp

    done = {
        (s.labels["adapter"], s.labels["finish_reason"]): s.value
        for s in _samples(fams["loraplex_requests"], "loraplex_requests_total")
    }
    assert done == {("sql", "length"): 2, ("poem", "length"): 1, ("base", "length"): 1}
    ttft = {
        s.labels["adapter"]: s.value
        for s in _samples(fams["loraplex_time_to_first_token_seconds"])
        if s.name.endswith("_count")
    }
    assert ttft == {"sql": 2, "poem": 1, "base": 1}
    itl_count = [
        s
        for s in _samples(fams["loraplex_inter_token_latency_seconds"])
        if s.name.endswith("_count")
    ]
    assert sum(s.value for s in itl_count) == 4 * 2  # 3 tokens: 2 gaps per request

    stages = {s.labels["stage"] for s in _samples(fams["loraplex_adapter_load_stage_seconds"])}
    assert {"fetch", "verify", "stage", "h2d", "total"} <= stages
    kv = {s.labels["state"]: s.value for s in _samples(fams["loraplex_kv_blocks"])}
    assert kv["used"] == 0 and kv["free"] > 0
    tiers = {s.labels["tier"]: s.value for s in _samples(fams["loraplex_adapters_resident"])}
    assert tiers["gpu"] == 2 and tiers["cpu"] >= 2
    hits = {s.labels["tier"] for s in _samples(fams["loraplex_adapter_hits"])}
    assert hits == {"gpu", "cpu"} and "loraplex_adapter_misses" in fams
    assert "loraplex_adapter_evictions" in fams and "loraplex_num_requests" in fams
    # an own registry: nothing leaks into the process-wide default one
    assert REGISTRY.get_sample_value("loraplex_requests_total", {"adapter": "sql"}) is None


def test_adapter_labels_keep_only_the_top_k():
    demoted = []
    labels = AdapterLabels(2, on_demote=demoted.append)
    assert [labels.observe(n) for n in ("a", "b", "c")] == ["a", "b", OTHER_LABEL]
    assert labels.observe(None) == "base"
    assert labels.observe("c") == "c" and demoted == ["a"]  # c (2) overtakes a (1)
    assert labels.top == {"b", "c"}
    assert AdapterLabels(0).observe("a") == OTHER_LABEL


def test_demoted_adapter_series_are_removed():
    m = Metrics(top_k=1)

    def finish(adapter):
        m.on_event(
            "request_finished",
            {"adapter": adapter, "finish_reason": "stop", "ttft_s": 0.01, "itl_s": [0.001]},
        )

    finish("a")
    finish("b")  # a holds the only own label: b counts as "other"
    finish("b")  # now b (2) > a (1): b takes the label, a's series go
    get = m.registry.get_sample_value
    assert get("loraplex_requests_total", {"adapter": "a", "finish_reason": "stop"}) is None
    assert get("loraplex_requests_total", {"adapter": "b", "finish_reason": "stop"}) == 1
    assert get("loraplex_requests_total", {"adapter": "other", "finish_reason": "stop"}) == 1
    assert get("loraplex_time_to_first_token_seconds_count", {"adapter": "a"}) is None
