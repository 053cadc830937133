"""AsyncEngine end to end on CPU: continuous batching, LoRA slots, KV paging, streaming."""

from __future__ import annotations

import asyncio
import random

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import AdapterDigestError, AdapterNotFoundError, InvalidRequestError
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.peft_oracle import HFReference, compare


async def test_concurrent_mixed_adapters_match_hf_peft(tiny):
    model_dir, adapters = tiny
    g = random.Random(11)
    choices = [None, *adapters]
    reqs = []
    for i in range(36):
        prompt = [g.randrange(3, 250) for _ in range(g.randint(1, 40))]
        reqs.append((f"r{i}", prompt, g.choice(choices), g.randint(3, 10)))
    params = {r[0]: SamplingParams(max_tokens=r[3], temperature=0.0, ignore_eos=True) for r in reqs}
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, adapters)
        results = await asyncio.gather(
            *(collect(engine, p, params[rid], adapter=a, request_id=rid) for rid, p, a, _ in reqs)
        )
        alone = []
        for rid, p, a, _ in reqs[:12]:
            alone.append(await collect(engine, p, params[rid], adapter=a))
        stats = engine.stats()
        assert_idle(engine)
    assert stats["adapters"]["gpu_evictions"] > 0, "max_loras < adapters in use must evict slots"
    hf = HFReference(model_dir, adapters)
    cut = 0
    for (_rid, prompt, adapter, n), (tokens, _, outs) in zip(reqs, results, strict=True):
        ref, gaps = hf.greedy(prompt, adapter, n)
        cut += compare(tokens, ref, gaps)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
    for (tokens, _, _), (ta, _, _) in zip(results, alone, strict=False):
        assert tokens == ta
    print(f"positions cut at near-ties: {cut}")


async def test_tiny_kv_pool_forces_preemption_and_stays_exact(tiny):
    model_dir, adapters = tiny
    g = random.Random(5)
    reqs = [
        ([g.randrange(3, 250) for _ in range(g.randint(6, 14))], g.choice([None, "sql", "poem"]))
        for _ in range(8)
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = config(model_dir, num_kv_blocks=16, max_loras=2)
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        together = await asyncio.gather(*(collect(engine, p, params, adapter=a) for p, a in reqs))
        preemptions = engine.stats()["preemptions"]
        alone = [await collect(engine, p, params, adapter=a) for p, a in reqs]
        assert_idle(engine)
    assert preemptions > 0
    assert [t for t, _, _ in together] == [t for t, _, _ in alone]


async def test_prefix_cache_hits_never_cross_adapters_or_versions(tiny, tmp_path):
    model_dir, adapters = tiny
    prompt = list(range(10, 40))  # 30 tokens = 7 full blocks of 4
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, adapters)

        async def hits(adapter):
            before = engine.stats()["prefix_cache_hits"]
            _, _, outs = await collect(engine, prompt, params, adapter=adapter)
            return engine.stats()["prefix_cache_hits"] - before, outs[-1].num_cached_tokens

        assert (await hits("sql"))[0] == 0
        h, cached = await hits("sql")
        assert h > 0 and cached == 4 * h
        assert (await hits("poem"))[0] == 0
        assert (await hits(None))[0] == 0
        assert (await hits(None))[0] > 0
        # a new version of "sql" (other content, same name) never reuses the old KV
        from tests.helpers.models import make_peft_adapter

        new_sql = make_peft_adapter(model_dir, tmp_path / "sql2", r=4, alpha=8, seed=999)
        await engine.add_adapter("sql", f"file://{new_sql}")
        assert (await hits("sql"))[0] == 0
        assert (await hits("sql"))[0] > 0
        assert_idle(engine)


async def test_abort_and_cancellation_free_blocks_and_adapter_refs(tiny):
    model_dir, adapters = tiny
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, adapters)
        got = asyncio.Event()

        async def consume():
            async for _ in engine.generate(list(range(5, 25)), params, adapter="poem"):
                got.set()

        task = asyncio.create_task(consume())
        await got.wait()
        assert engine.stats()["num_used_blocks"] > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert_idle(engine)

        seen = []

        async def consume_abortable():
            async for out in engine.generate(
                [7, 8, 9], params, adapter="sql", request_id="to-abort"
            ):
                seen.append(out)
                if len(seen) == 2:
                    assert engine.abort("to-abort")

        await consume_abortable()
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        assert_idle(engine)


async def test_seeded_sampling_reproduces_across_batches(tiny):
    model_dir, adapters = tiny
    prompt = [3, 14, 15, 92, 65]
    p = SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, adapters)
        a, _, _ = await collect(engine, prompt, p, adapter="math")
        noise = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
        together = await asyncio.gather(
            collect(engine, prompt, p, adapter="math"),
            collect(engine, [5, 6, 7], noise, adapter="sql"),
            collect(engine, [9] * 9, noise),
        )
        assert together[0][0] == a
        other = SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True)
        b, _, _ = await collect(engine, prompt, other, adapter="math")
        assert b != a


async def test_stop_strings_never_stream_partially(tiny):
    model_dir, _ = tiny
    async with AsyncEngine(config(model_dir)) as engine:
        base = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        _, full, _ = await collect(engine, "hello world", base)
        assert len(full) > 6
        stop = full[3:6]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        tokens, text, outs = await collect(engine, "hello world", params)
        assert text == full[: full.index(stop)]
        streamed = ""
        for out in outs:
            streamed += out.text
            assert stop not in streamed
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


async def test_typed_errors_keep_engine_serving(tiny):
    model_dir, adapters = tiny
    async with AsyncEngine(config(model_dir)) as engine:
        with pytest.raises(AdapterDigestError, match="sha256"):
            await engine.add_adapter("bad", f"file://{adapters['sql']}", sha256="0" * 64)
        with pytest.raises(AdapterNotFoundError):
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=2), adapter="nope")
        with pytest.raises(InvalidRequestError):
            await collect(engine, [], SamplingParams(max_tokens=2))
        with pytest.raises(InvalidRequestError):
            await collect(engine, [1, 2, 100000], SamplingParams(max_tokens=2))
        tokens, _, _ = await collect(
            engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)
        )
        assert len(tokens) == 3
        assert_idle(engine)


async def test_unexpected_loop_error_fails_requests_instead_of_hanging(tiny, monkeypatch):
    """A bug outside the step (here: schedule() raising once) fails the affected requests
    with the error; the engine keeps serving afterwards."""
    model_dir, _ = tiny
    async with AsyncEngine(config(model_dir)) as engine:
        sched = engine.testing.scheduler
        real = sched.schedule
        calls = {"n": 0}

        def broken():
            if sched.waiting and calls["n"] == 0:
                calls["n"] += 1
                raise RuntimeError("scheduler bug")
            return real()

        monkeypatch.setattr(sched, "schedule", broken)
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        with pytest.raises(RuntimeError, match="scheduler bug"):
            await asyncio.wait_for(collect(engine, [1, 2, 3], params), timeout=30)
        tokens, _, _ = await asyncio.wait_for(collect(engine, [1, 2, 3], params), timeout=30)
        assert len(tokens) == 3
        assert_idle(engine)


async def test_static_sources_do_not_widen_runtime_loads(tiny, tmp_path):
    model_dir, adapters = tiny
    async with AsyncEngine(config(model_dir)) as engine:
        uri = f"file://{adapters['sql']}"
        with pytest.raises(AdapterDigestError):
            await engine.add_adapter("bad", uri, sha256="0" * 64)
        # a static source (even one whose registration failed) is no runtime (untrusted) source
        from loraplex.engine.errors import AdapterPolicyError

        with pytest.raises(AdapterPolicyError):
            await engine.add_adapter("sneaky", uri, trusted=False)


async def test_starved_request_gets_a_slot_swap_under_constant_load(tiny):
    """One GPU slot, a steady stream of requests on adapter "sql" keeps it referenced; a request
    on "poem" that waits past starvation_timeout_s is admitted first: admissions pause until
    the slot drains and is swapped."""
    model_dir, adapters = tiny
    cfg = config(model_dir, max_loras=1, max_cpu_loras=2, starvation_timeout_s=0.05)
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        stop = asyncio.Event()
        served = []

        async def sql_stream(i):
            while not stop.is_set():
                p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                await collect(engine, [3 + i, 4, 5], p, adapter="sql")
                served.append(i)

        streams = [asyncio.create_task(sql_stream(i)) for i in range(3)]
        while len(served) < 3:  # the slot is busy with "sql"
            await asyncio.sleep(0.01)
        p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        tokens, _, outs = await asyncio.wait_for(collect(engine, [9, 9, 9], p, adapter="poem"), 60)
        assert len(tokens) == 4 and outs[-1].finish_reason == "length"
        stop.set()
        await asyncio.gather(*streams)
        assert engine.stats()["adapters"]["gpu_evictions"] >= 1
        assert_idle(engine)
