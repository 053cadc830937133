"""Prometheus metrics of one engine, in an own ``CollectorRegistry``.

Two sources: values read from ``engine.stats()`` at scrape time (a custom collector: the
model-server protocol of the Gateway API Inference Extension, metrics_protocol.py; adapter
residency, metrics_residency.py; KV blocks, queue sizes) and engine events
(``engine.subscribe``: per-adapter request counts, TTFT / inter-token latency, adapter load
stages). docs/metrics.md lists every metric.

Adapter labels are bounded: the top-K adapters by request count get their own label value,
every other adapter is ``"other"`` and the base model is ``"base"``. When an adapter climbs into
the top K, the one it displaces has its series removed, so at most K + 2 values ever exist.
"""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.metrics_protocol import ProtocolView, cache_config_family, protocol_families
from loraplex.engine.metrics_residency import Residency, ResidentAdapter, residency_families
from loraplex.engine.metrics_spec import spec_families

__all__ = ["Metrics", "AdapterLabels", "BASE_LABEL", "OTHER_LABEL", "read_residency"]

BASE_LABEL, OTHER_LABEL = "base", "other"
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
LOAD_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class AdapterLabels:
    """Maps adapter names to a bounded set of label values (see the module docstring)."""

    def __init__(self, top_k: int, on_demote: Callable[[str], None] = lambda name: None) -> None:
        self.top_k = top_k
        self.counts: Tally[str] = Tally()
        self.top: set[str] = set()
        self.on_demote = on_demote

    def observe(self, name: str | None) -> str:
        """Count one request of ``name`` and return its label value."""
        if name is None:
            return BASE_LABEL
        self.counts[name] += 1
        if name in self.top:
            return name
        if len(self.top) < self.top_k:
            self.top.add(name)
            return name
        if not self.top:
            return OTHER_LABEL
        weakest = min(self.top, key=lambda n: (self.counts[n], n))
        if self.counts[name] <= self.counts[weakest]:
            return OTHER_LABEL
        self.top.discard(weakest)
        self.top.add(name)
        self.on_demote(weakest)
        return name


def read_residency(engine: Any, stats: dict[str, Any]) -> Residency:
    """Adapter residency of ``engine`` (``stats``: its ``stats()`` of this scrape).

    The one place metrics read adapter residency: an ``AsyncEngine`` lists its versions
    (``adapter_residency``); any other engine (the Ray ingress's ``ClusterEngine``) has only
    its stats: counts, no versions.
    """
    loaded = {
        "gpu": len(stats.get("gpu_resident") or ()),
        "cpu": len(stats.get("cpu_resident") or ()),
    }
    capacity = {"gpu": int(stats.get("max_loras") or 0)}
    counters = dict(stats.get("adapters") or {})
    if not isinstance(engine, AsyncEngine):
        return Residency(None, loaded, capacity, counters)
    cfg = engine.config
    capacity["cpu"] = max(cfg.max_cpu_loras, cfg.max_loras)  # (as the adapter manager holds it)
    rows = tuple(ResidentAdapter(**row) for row in engine.adapter_residency())
    return Residency(rows, loaded, capacity, counters)


def _cache_config(engine: Any, stats: dict[str, Any]) -> Metric:
    """``vllm:cache_config_info`` of ``engine``: the block size from its config (a cluster
    front: from a replica's capacity report; every replica runs one config)."""
    if isinstance(engine, AsyncEngine):
        block_size, prefix = engine.config.block_size, engine.config.enable_prefix_caching
    else:
        cap = engine.capacity_report()
        block_size, prefix = cap["kv_tokens"] // max(cap["kv_blocks"], 1), None
    return cache_config_family(block_size, int(stats.get("num_blocks") or 0), prefix)


class _StatsCollector(Collector):
    """Reads ``engine.stats()`` at scrape time; yields nothing while no engine is running."""

    def __init__(self, labels: AdapterLabels) -> None:
        self.engine: AsyncEngine | None = None
        self.labels = labels

    def label_of(self, name: str) -> str:
        """An adapter's label value where only its name is known ("": the base model)."""
        if not name:
            return BASE_LABEL
        return name if name in self.labels.top else OTHER_LABEL

    def collect(self) -> Iterator[Metric]:
        if self.engine is None:
            return
        try:
            s = self.engine.stats()
            model = self.engine.model_name
        except Exception:  # noqa: BLE001 - engine closed: nothing to report
            return
        yield from protocol_families(ProtocolView.of(s), model)
        yield _cache_config(self.engine, s)
        yield from residency_families(read_residency(self.engine, s))
        yield from _engine_families(s)
        yield from spec_families(s, self.label_of)


def _engine_families(s: dict[str, Any]) -> Iterator[Metric]:
    """The engine's own families (names kept from before the protocol families came)."""
    yield _labelled(
        GaugeMetricFamily, "loraplex_num_requests", "Requests by scheduler queue.", "state",
        {"running": s["running"], "waiting": s["waiting"]},
    )  # fmt: skip
    yield _labelled(
        GaugeMetricFamily, "loraplex_adapters_resident",
        "Adapters resident per tier (as loraplex:adapters_loaded).", "tier",
        {"gpu": len(s["gpu_resident"]), "cpu": len(s["cpu_resident"])},
    )  # fmt: skip
    a = s["adapters"]
    yield _labelled(
        CounterMetricFamily, "loraplex_adapter_hits", "Requests whose adapter was resident.",
        "tier", {"gpu": a.get("gpu_hits", 0), "cpu": a.get("cpu_hits", 0)},
    )  # fmt: skip
    yield CounterMetricFamily(
        "loraplex_adapter_misses",
        "Requests whose adapter was resident in no tier (a cold load).",
        a.get("misses", a.get("loads", 0)),
    )
    yield CounterMetricFamily(
        "loraplex_adapter_load_failures", "Adapter loads that failed.", a.get("load_failures", 0)
    )
    yield _labelled(
        CounterMetricFamily, "loraplex_adapter_evictions", "Adapters evicted per tier.",
        "tier", {"gpu": a.get("gpu_evictions", 0), "cpu": a.get("cpu_evictions", 0)},
    )  # fmt: skip
    yield _labelled(
        GaugeMetricFamily, "loraplex_kv_blocks", "KV cache blocks by state.", "state",
        {"used": s["num_used_blocks"], "free": s["num_free_blocks"]},
    )  # fmt: skip
    yield CounterMetricFamily(
        "loraplex_preemptions", "Requests preempted for KV space.", s["preemptions"]
    )
    yield _labelled(
        CounterMetricFamily, "loraplex_prefix_cache", "Prefix cache block lookups.", "result",
        {"query": s["prefix_cache_queries"], "hit": s["prefix_cache_hits"]},
    )  # fmt: skip
    yield CounterMetricFamily("loraplex_engine_steps", "Engine steps run.", s.get("steps", 0))
    yield CounterMetricFamily(
        "loraplex_kernel_compiles_while_serving",
        "Triton kernels compiled after start-up (each one stalls every stream).",
        s.get("kernel_compiles_while_serving", 0),
    )
    yield GaugeMetricFamily(
        "loraplex_host_pool_regions_in_use",
        "Host-pool regions holding CPU-tier adapters.",
        s.get("host_pool_regions_in_use", 0),
    )


def _labelled(cls: Any, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    family = cls(name, doc, labels=[label])
    for value, v in values.items():
        family.add_metric([value], v)
    return family


class Metrics:
    """Registry + metric objects; ``attach(engine)`` subscribes to the engine's events."""

    def __init__(self, top_k: int = 16) -> None:
        self.registry = CollectorRegistry()
        self.labels = AdapterLabels(top_k, on_demote=self._forget)
        self._stats = _StatsCollector(self.labels)
        self.registry.register(self._stats)
        r = self.registry
        self.requests = Counter(
            "loraplex_requests", "Finished requests.", ["adapter", "finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens of finished requests.", ["adapter"], registry=r
        )
        self.output_tokens = Counter(
            "loraplex_generation_tokens", "Generated tokens.", ["adapter"], registry=r
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds", "Arrival to first token.", ["adapter"],
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "loraplex_inter_token_latency_seconds", "Time between consecutive tokens.",
            ["adapter"], buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "loraplex_request_queue_seconds", "Arrival to first scheduling.", ["adapter"],
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "loraplex_e2e_request_latency_seconds", "Arrival to finish.", ["adapter"],
            buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.load_seconds = Histogram(
            "loraplex:adapter_load_seconds",
            "Adapter load time per stage (h2d: a GPU slot write, also when the adapter came "
            "from the CPU tier; total: a load into the CPU tier, fetch to parsed tensors).",
            ["stage"], buckets=LOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.load_stage = Histogram(  # (the name before loraplex:adapter_load_seconds)
            "loraplex_adapter_load_stage_seconds", "Adapter cold-load time per stage.", ["stage"],
            buckets=LOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.vllm_load = Histogram(
            "vllm:lora_adapter_load_seconds",
            "LoRA adapter load time into the CPU tier (fetch, verify, parse; slot writes apart).",
            buckets=LOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.loads = Counter(
            "loraplex_adapter_loads", "Adapter loads finished.", ["result"], registry=r
        )
        self.slot_bytes = Counter(
            "loraplex_adapter_slot_write_bytes", "Bytes copied into GPU slots.", registry=r
        )
        self.loop_lag = Histogram(
            "loraplex_event_loop_lag_seconds",
            "How late a due callback ran on the engine's event loop (sampled every 5 ms).",
            buckets=LAG_BUCKETS, registry=r,
        )  # fmt: skip

    def attach(self, engine: AsyncEngine) -> None:
        """Read stats from ``engine`` at scrape time and follow its events."""
        self._stats.engine = engine
        engine.subscribe(self.on_event)

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event == "request_finished":
            self._request(data)
        elif event == "adapter_load":
            self._load(data)
        elif event == "loop_lag":
            self.loop_lag.observe(data["lag_s"])
        elif event == "slot_write":
            self._stage("h2d", data.get("h2d_s") or 0.0)
            self.slot_bytes.inc(data.get("nbytes") or 0)

    def _request(self, d: dict[str, Any]) -> None:
        label = self.labels.observe(d.get("adapter"))
        self.requests.labels(label, d.get("finish_reason") or "error").inc()
        self.prompt_tokens.labels(label).inc(d.get("prompt_tokens") or 0)
        self.output_tokens.labels(label).inc(d.get("output_tokens") or 0)
        for hist, key in ((self.ttft, "ttft_s"), (self.queue, "queue_s"), (self.e2e, "e2e_s")):
            if d.get(key) is not None:
                hist.labels(label).observe(d[key])
        itl = self.itl.labels(label)
        for gap in d.get("itl_s") or ():
            itl.observe(gap)

    def _load(self, d: dict[str, Any]) -> None:
        self.loads.labels("ok" if d.get("ok") else "error").inc()
        if not d.get("ok"):
            return
        for stage, seconds in (d.get("timings") or {}).items():
            # NOTE: h2d is observed from slot_write; "*_start" keys are timestamps, not spans.
            if not stage.startswith("h2d") and not stage.endswith("_start"):
                self._stage(stage, seconds)
        if d.get("total_s") is not None:
            self._stage("total", d["total_s"])
            self.vllm_load.observe(d["total_s"])

    def _stage(self, stage: str, seconds: float) -> None:
        self.load_seconds.labels(stage).observe(seconds)
        self.load_stage.labels(stage).observe(seconds)

    def _forget(self, adapter: str) -> None:
        """Drop the series of an adapter that left the top K (it counts as "other" now)."""
        per_adapter = (self.prompt_tokens, self.output_tokens, self.ttft, self.itl, self.queue)
        for metric in (*per_adapter, self.e2e):
            with contextlib.suppress(KeyError):
                metric.remove(adapter)
        for reason in FINISH_REASONS:
            with contextlib.suppress(KeyError):
                self.requests.remove(adapter, reason)
