"""Adapter lifecycle, loads: held loads never stall decoding, single flight, cancellation
mid-load leaks nothing, and versioned reload while the old version is still streaming."""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.adapters.registry import AdapterState
from tests.helpers.lifecycle import (
    HeldPlugin,
    StepGate,
    assert_idle,
    collect,
    config,
    derived_adapter,
    staged_leftovers,
    wait_until,
)
from tests.helpers.peft_oracle import HFReference, compare

PROMPT = [12, 7, 200, 45, 3, 88, 19, 5]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def held_config(model_dir, tmp_path, **kw):
    return config(
        model_dir,
        lora_name_template="held://lib/{name}",
        allow_sources=("held://lib/*",),
        adapter_cache_dir=str(tmp_path / "cache"),
        **kw,
    )


async def test_held_load_never_stalls_other_requests(tiny, tmp_path):
    model_dir, adapters = tiny
    plugin = HeldPlugin({"poem": adapters["poem"]})
    base_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(held_config(model_dir, tmp_path)) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "held")
        waiting = [
            asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="poem")) for _ in range(3)
        ]
        await asyncio.wait_for(plugin.started.wait(), 30)
        v = engine.testing.adapters.registry.get("poem")
        assert v.state is AdapterState.LOADING and plugin.waiting == 1
        # the load is parked inside the resolver: base and warm requests stream to the end
        chunks = 0
        async for _out in engine.generate(PROMPT, base_params):
            chunks += 1
            assert v.state is AdapterState.LOADING and not plugin.gate.is_set()
        assert chunks == base_params.max_tokens
        assert not any(t.done() for t in waiting)
        assert engine.stats()["waiting_adapters"] == ["poem"]
        plugin.gate.set()
        results = await asyncio.wait_for(asyncio.gather(*waiting), 30)
        assert plugin.opens == ["poem"]
        assert_idle(engine)
    hf = HFReference(model_dir, {"poem": adapters["poem"]})
    ref = hf.greedy(PROMPT, "poem", GREEDY.max_tokens)
    for tokens, _, outs in results:
        compare(tokens, *ref)
        assert outs[-1].finish_reason == "length"


async def test_twenty_requests_for_one_cold_adapter_load_it_once(tiny, tmp_path):
    model_dir, adapters = tiny
    plugin = HeldPlugin({"math": adapters["math"]})
    async with AsyncEngine(held_config(model_dir, tmp_path)) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "held")
        tasks = [
            asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="math")) for _ in range(20)
        ]
        await asyncio.wait_for(plugin.started.wait(), 30)

        def users() -> list[int]:
            return [r["users"] for r in engine.stats()["adapter_refs"].values()]

        # (the intake lets the 20 calls through one per millisecond)
        await wait_until(lambda: users() == [20], "every request waits on the one load")
        plugin.gate.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        stats = engine.stats()["adapters"]
        assert stats["loads"] == 1 and plugin.opens == ["math"]
        assert stats["misses"] == 20 and stats["load_failures"] == 0
        assert_idle(engine)
    assert len({tuple(t) for t, _, _ in results}) == 1


async def test_cancelling_every_waiter_mid_load_leaks_nothing(tiny, tmp_path):
    model_dir, adapters = tiny
    plugin = HeldPlugin({"chat": adapters["chat"], "sql": adapters["sql"]})
    async with AsyncEngine(held_config(model_dir, tmp_path)) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "held")
        # a completed version whose staged files must survive
        plugin.gate.set()
        await collect(engine, PROMPT, GREEDY, adapter="sql")
        plugin.gate.clear()
        plugin.started.clear()

        tasks = [
            asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="chat")) for _ in range(20)
        ]
        await asyncio.wait_for(plugin.started.wait(), 30)
        v = engine.testing.adapters.registry.get("chat")
        await wait_until(lambda: v.users == 20, "every request past the intake, on the load")
        load = v.load_task
        assert load is not None and not load.done()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with pytest.raises(asyncio.CancelledError):
                await t
        await asyncio.wait({load}, timeout=30)
        assert load.cancelled()
        assert plugin.cancelled == 1 and plugin.waiting == 0
        slots = engine.testing.adapters.slots
        assert v.users == 0 and slots.refs(v) == 0 and slots.slot_of(v) is None
        assert v.adapter is None
        assert (
            "chat" not in engine.testing.adapters.registry.names()
        )  # the dynamic name is forgotten
        stats = engine.stats()
        assert stats["num_used_blocks"] == 0 and stats["aborted"] == 20
        assert stats["adapters"]["load_failures"] == 0
        assert_idle(engine)
        await wait_until(lambda: not staged_leftovers(engine), "cancelled staging removed")
        sql_dir = engine.testing.adapters.registry.get("sql").local_dir
        assert sql_dir is not None and sql_dir.is_dir()  # the completed version is kept

        # a later request resolves the name again and loads it
        plugin.gate.set()
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="chat")
        assert plugin.opens == ["sql", "chat", "chat"]
        assert engine.stats()["adapters"]["loads"] == 3
        assert_idle(engine)
    hf = HFReference(model_dir, {"chat": adapters["chat"]})
    compare(tokens, *hf.greedy(PROMPT, "chat", GREEDY.max_tokens))


async def test_request_arriving_while_a_cancelled_load_unwinds_is_served(tiny, tmp_path):
    """The last waiter leaves (its load is cancelled) and a new request for the same name
    arrives before the load task has unwound: the newcomer is served, and requests after it
    share its version (one load, not one per request)."""
    model_dir, adapters = tiny
    plugin = HeldPlugin({"chat": adapters["chat"]})
    async with AsyncEngine(held_config(model_dir, tmp_path)) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "held")
        first = asyncio.create_task(
            collect(engine, PROMPT, GREEDY, adapter="chat", request_id="first")
        )
        await asyncio.wait_for(plugin.started.wait(), 30)
        v = engine.testing.adapters.registry.get("chat")
        cancelled = v.load_task
        assert engine.abort("first")  # the last waiter: its load is cancelled ...
        late = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="chat"))
        await asyncio.sleep(0)  # ... and the newcomer joins before the load unwinds
        assert v.users == 1 and not cancelled.done()
        _, _, outs = await asyncio.wait_for(first, 30)
        assert outs[-1].finish_reason == "abort"
        await asyncio.wait({cancelled}, timeout=30)
        assert cancelled.cancelled()
        later = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="chat"))
        await asyncio.sleep(0)
        assert (
            engine.testing.adapters.registry.get("chat") is v
        )  # still the one version of the name
        plugin.gate.set()
        results = await asyncio.wait_for(asyncio.gather(late, later), 30)
        assert all(len(t) == GREEDY.max_tokens for t, _, _ in results)
        assert plugin.opens == ["chat", "chat"]  # the cancelled fetch and one retry
        assert engine.stats()["adapters"]["loads"] == 2
        assert_idle(engine)
        await wait_until(lambda: not staged_leftovers(engine), "staging dirs settled")


async def test_versioned_reload_while_old_version_streams(tiny, tmp_path):
    model_dir, adapters = tiny
    old_dir = adapters["math"]
    new_dir = derived_adapter(old_dir, tmp_path / "math-v2", seed=3)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    finished: dict[str, str] = {}
    cfg = config(model_dir, adapter_cache_dir=str(tmp_path / "cache"))
    async with AsyncEngine(cfg) as engine:
        engine.subscribe(
            lambda e, d: (
                finished.__setitem__(d["request_id"], d["adapter_digest"])
                if e == "request_finished"
                else None
            )
        )
        old = await engine.add_adapter("math", f"file://{old_dir}")
        v_old = engine.testing.adapters.registry.get("math")
        staged_old = v_old.local_dir
        # park the step loop once the old request streams, and reload the name meanwhile
        gate = StepGate(
            engine, lambda plan: any(c.req.output_ids for c in plan.chunks if c.req.adapter)
        )
        old_task = asyncio.create_task(
            collect(engine, PROMPT, long, adapter="math", request_id="old")
        )
        await asyncio.wait_for(gate.reached.wait(), 30)
        new = await engine.add_adapter("math", f"file://{new_dir}")
        assert new["digest"] != old["digest"] and new["version"] > old["version"]
        v_new = engine.testing.adapters.registry.get("math")
        news = [
            asyncio.create_task(
                collect(engine, PROMPT, GREEDY, adapter="math", request_id=f"new{i}")
            )
            for i in range(3)
        ]
        await wait_until(lambda: v_new.state is AdapterState.CPU, "the new version staged")
        gate.release()
        new_results = await asyncio.wait_for(asyncio.gather(*news), 30)
        assert "old" not in finished  # the old request is still streaming
        assert v_old.users == 1 and staged_old.is_dir()
        old_tokens, _, _ = await asyncio.wait_for(old_task, 30)
        assert finished["old"] == old["digest"][:12]
        assert all(finished[f"new{i}"] == new["digest"][:12] for i in range(3))
        assert v_old not in engine.testing.adapters.registry.versions()
        await wait_until(lambda: not staged_old.exists(), "old version's staged files removed")
        assert engine.testing.adapters.registry.get("math").local_dir.is_dir()
        assert_idle(engine)
    hf = HFReference(model_dir, {"old": old_dir, "new": new_dir})
    compare(old_tokens, *hf.greedy(PROMPT, "old", long.max_tokens))
    ref_new = hf.greedy(PROMPT, "new", GREEDY.max_tokens)
    for tokens, _, _ in new_results:
        compare(tokens, *ref_new)
    assert ref_new[0] != hf.greedy(PROMPT, "old", GREEDY.max_tokens)[0]


async def test_adapter_refs_list_every_live_version(tiny, tmp_path):
    """Two live versions of one name whose digests are not known yet (both still loading)
    are two entries of stats()['adapter_refs'], so assert_idle sees the refs of both."""
    model_dir, adapters = tiny
    plugin = HeldPlugin({"poem": adapters["poem"]})
    async with AsyncEngine(held_config(model_dir, tmp_path)) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "held")
        first = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="poem"))
        await asyncio.wait_for(plugin.started.wait(), 30)
        await engine.remove_adapter("poem")  # the waiting request keeps its version
        second = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="poem"))
        await wait_until(lambda: plugin.waiting == 2, "both loads parked")
        refs = engine.stats()["adapter_refs"]
        assert sorted(r["users"] for r in refs.values()) == [1, 1], refs
        plugin.gate.set()
        (a, _, _), (b, _, _) = await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert a == b and plugin.opens == ["poem", "poem"]
        assert_idle(engine)


async def test_cancelled_while_loaded_before_tokenizing_leaks_nothing(tiny, tmp_path):
    """Where adapters may add tokens (lora_extra_vocab_size > 0) a name resolved at request
    time is loaded before the request is tokenized (``load_before_tokenizing``): requests
    cancelled in that wait cancel the load and forget the name, as waiters of a request's
    load do; the next request loads it and counts as the one miss."""
    model_dir, adapters = tiny
    plugin = HeldPlugin({"chat": adapters["chat"]})
    conf = held_config(model_dir, tmp_path, max_full_module_loras=1, lora_extra_vocab_size=4)
    async with AsyncEngine(conf) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "held")
        tasks = [
            asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="chat")) for _ in range(5)
        ]
        await asyncio.wait_for(plugin.started.wait(), 30)
        v = engine.testing.adapters.registry.get("chat")
        await wait_until(lambda: v.users == 5, "every request holding the load")
        assert engine.stats()["waiting"] == 0  # none submitted: they wait to be tokenized
        load = v.load_task
        for t in tasks:
            t.cancel()
        for t in tasks:
            with pytest.raises(asyncio.CancelledError):
                await t
        await asyncio.wait({load}, timeout=30)
        assert load.cancelled() and plugin.cancelled == 1
        assert v.users == 0 and v.adapter is None
        assert "chat" not in engine.testing.adapters.registry.names()
        assert_idle(engine)
        await wait_until(lambda: not staged_leftovers(engine), "cancelled staging removed")

        plugin.gate.set()
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="chat")
        stats = engine.stats()["adapters"]
        assert stats["misses"] == 1 and stats["cpu_hits"] == 0 and stats["loads"] == 2, stats
        assert_idle(engine)
    hf = HFReference(model_dir, {"chat": adapters["chat"]})
    compare(tokens, *hf.greedy(PROMPT, "chat", GREEDY.max_tokens))
