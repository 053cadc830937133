"""Speculative decoding's counters in ``engine.stats()`` and on /metrics' registry."""

from __future__ import annotations

from prometheus_client import generate_latest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.metrics import Metrics
from tests.helpers.engine import collect, config, register


async def test_spec_families_per_adapter_label(tiny):
    model_dir, adapters = tiny
    loop = [31, 32, 33, 34, 35, 36, 37]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config(model_dir, speculative_method="ngram")) as engine:
        await register(engine, {"sql": adapters["sql"]})
        metrics = Metrics()
        metrics.attach(engine)
        text = generate_latest(metrics.registry).decode()
        assert "loraplex:spec_decode_proposed_tokens_total{" not in text  # nothing yet
        await collect(engine, loop * 3, params)
        await collect(engine, loop * 3, params, adapter="sql")
        s = engine.stats()["speculative"]
        text = generate_latest(metrics.registry).decode()
    assert s["k"] == 4 and set(s["per_adapter"]) == {"", "sql"}
    for label in ("base", "sql"):
        per = s["per_adapter"]["" if label == "base" else "sql"]
        assert per["proposed_tokens"] > 0
        line = f'loraplex:spec_decode_proposed_tokens_total{{adapter="{label}"}} '
        assert line + f"{float(per['proposed_tokens'])}" in text
        rows = sum(per["acceptance_lengths"])
        assert (
            f'loraplex:spec_decode_acceptance_length_count{{adapter="{label}"}} {float(rows)}'
            in text
        )
    assert 'loraplex:spec_decode_accepted_tokens_total{adapter="sql"}' in text
    for label, name in (("base", ""), ("sql", "sql")):
        backoff = float(s["per_adapter"][name]["backoff_rows"])
        assert f'loraplex:spec_decode_backoff_rows_total{{adapter="{label}"}} {backoff}' in text
    assert 'loraplex:spec_decode_acceptance_length_bucket{adapter="sql",le="4"}' in text
