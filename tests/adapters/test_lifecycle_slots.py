"""Adapter lifecycle, residency: more adapters in use than GPU slots and CPU-tier places,
slot safety while evicting, pinned slots, and a slot write racing the version's collection."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.adapters.registry import SlotFullError
from tests.helpers.lifecycle import (
    StepGate,
    assert_idle,
    collect,
    config,
    derived_adapter,
    staged_leftovers,
    wait_until,
)
from tests.helpers.peft_oracle import HFReference, compare

PROMPT = [4, 61, 23, 8, 190, 33]


def watch_slots(engine):
    """Wrap the slot store's assign and prepare: every slot taken from an owner is
    unreferenced, and count the steps in which a slot is written while other rows read LoRA
    slots."""
    internals = engine.testing
    slots, executor = internals.adapters.slots, internals.executor
    seen = {"evictions": 0, "mixed_steps": 0, "writes": 0}
    assign, prepare = slots.assign, executor.prepare

    def checked_assign(v, *, force=False):
        owners = {i: slots.owner(i) for i in range(slots.num_slots)}
        refs = {i: slots.refs(o) for i, o in owners.items() if o is not None}
        slot = assign(v, force=force)
        old = owners.get(slot) if slot is not None else None
        if old is not None and old is not v:
            seen["evictions"] += 1
            assert refs[slot] == 0, f"slot {slot} taken from {old.key} with readers"
            assert not any(r.adapter is old for r in internals.scheduler.running), old.key
        return slot

    def checked_prepare(plan, prev=None):
        read = {c.req.slot for c in plan.chunks if c.req.adapter is not None}
        if plan.slot_writes:
            seen["writes"] += len(plan.slot_writes)
            if read:
                seen["mixed_steps"] += 1
        return prepare(plan, prev)  # asserts the engine's own slot-safety invariants

    slots.assign = checked_assign
    executor.prepare = checked_prepare
    return seen


async def test_more_adapters_than_slots_and_cpu_tier(tiny, tmp_path):
    model_dir, adapters = tiny
    root = tmp_path / "root"
    sources = dict(adapters)
    sources["sql2"] = derived_adapter(adapters["sql"], tmp_path / "sql2", seed=1)
    sources["poem2"] = derived_adapter(adapters["poem"], tmp_path / "poem2", seed=2)
    for name, path in sources.items():
        shutil.copytree(path, root / name)
    g = random.Random(23)
    names = [None, *sources]

    def request(i: int, adapter: str | None) -> tuple:
        prompt = [g.randrange(3, 250) for _ in range(g.randint(2, 14))]
        return (f"r{i}", prompt, adapter, g.randint(2, 8))

    # wave 1: 28 mixed requests at once; wave 2: every adapter again (some were evicted)
    wave1 = [request(i, names[i % len(names)]) for i in range(28)]
    g.shuffle(wave1)
    wave2 = [request(28 + i, list(sources)[i % len(sources)]) for i in range(12)]
    g.shuffle(wave2)
    cfg = config(
        model_dir,
        max_loras=2,
        max_cpu_loras=3,
        max_num_seqs=8,
        local_roots=(str(root),),
        lora_name_template=f"file://{root}/{{name}}",
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    async with AsyncEngine(cfg) as engine:
        seen = watch_slots(engine)

        async def run(reqs):
            return await asyncio.wait_for(
                asyncio.gather(
                    *(
                        collect(
                            engine,
                            prompt,
                            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                            adapter=adapter,
                            request_id=rid,
                        )
                        for rid, prompt, adapter, n in reqs
                    )
                ),
                120,
            )

        results = await run(wave1)
        assert_idle(engine)
        mid = engine.stats()
        assert len(mid["gpu_resident"]) <= 2
        evicted = [n for n in sources if n not in mid["cpu_resident"]]
        assert evicted and mid["adapters"]["cpu_evictions"] >= len(evicted), mid
        results += await run(wave2)
        stats = engine.stats()
        assert not engine._loop_task.done()
        assert_idle(engine)
        assert len(stats["cpu_resident"]) <= 3 and len(stats["gpu_resident"]) <= 2
        await wait_until(lambda: not staged_leftovers(engine), "staging settled")
    ad = stats["adapters"]
    assert ad["gpu_evictions"] > 0 and ad["cpu_evictions"] > 0, ad
    assert ad["load_failures"] == 0, ad
    assert ad["loads"] >= mid["adapters"]["loads"] + len(evicted), (mid, ad)  # reloads
    assert seen["evictions"] == ad["gpu_evictions"]
    assert seen["mixed_steps"] > 0, seen  # slots written while other slots were being read
    print(f"evicted after wave 1: {evicted}; stats {ad}; {seen}")
    hf = HFReference(model_dir, sources)
    for (_, prompt, adapter, n), (tokens, _, outs) in zip(wave1 + wave2, results, strict=True):
        compare(tokens, *hf.greedy(prompt, adapter, n))
        assert outs[-1].finish_reason == "length"


async def test_every_slot_pinned_gives_slot_full_error(tiny):
    model_dir, adapters = tiny
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(config(model_dir, max_loras=2, max_cpu_loras=4)) as engine:
        for name in ("sql", "poem", "math"):
            await engine.add_adapter(name, f"file://{adapters[name]}")
        engine.pin_adapter("sql")
        engine.pin_adapter("poem")
        warm = await asyncio.gather(
            collect(engine, PROMPT, short, adapter="sql"),
            collect(engine, PROMPT, short, adapter="poem"),
        )
        assert sorted(engine.stats()["gpu_resident"]) == ["poem", "sql"]

        async def refused():
            with pytest.raises(SlotFullError, match="pinned") as ei:
                await collect(engine, PROMPT, short, adapter="math")
            return ei.value

        base, sql, err, err2 = await asyncio.gather(
            collect(engine, PROMPT, long),
            collect(engine, PROMPT, long, adapter="sql"),
            refused(),
            refused(),
        )
        assert "'math'" in str(err) and type(err2) is SlotFullError
        assert len(base[0]) == len(sql[0]) == long.max_tokens
        assert sql[0][: short.max_tokens] == warm[0][0]
        assert sorted(engine.stats()["gpu_resident"]) == ["poem", "sql"]
        assert_idle(engine)
        engine.pin_adapter("poem", False)  # a slot can be taken again
        tokens, _, _ = await collect(engine, PROMPT, short, adapter="math")
        assert sorted(engine.stats()["gpu_resident"]) == ["math", "sql"]
        assert_idle(engine)
    hf = HFReference(model_dir, {"math": adapters["math"]})
    compare(tokens, *hf.greedy(PROMPT, "math", short.max_tokens))


async def test_slot_write_of_a_version_dropped_mid_step_fails_nobody(tiny, tmp_path):
    """A superseded version gets a slot for its last waiting request; while that step (which
    writes the slot) runs, the request is cancelled and the version is dropped. The step must
    still complete for the other rows, and the slot must be usable afterwards."""
    model_dir, adapters = tiny
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    new_dir = derived_adapter(adapters["sql"], tmp_path / "sql2", seed=5)
    # (requests wait for their write to land: the write's step has no row of the version)
    async with AsyncEngine(config(model_dir, slot_write_join_bytes=0)) as engine:
        await engine.add_adapter("sql", f"file://{adapters['sql']}")
        v_old = engine.testing.adapters.registry.get("sql")
        base = asyncio.create_task(collect(engine, PROMPT, long))
        await wait_until(lambda: engine.stats()["running"] == 1, "the base request running")
        gate = StepGate(engine, lambda plan: v_old in plan.slot_writes)
        doomed = asyncio.create_task(collect(engine, PROMPT, short, adapter="sql"))
        await asyncio.wait_for(gate.reached.wait(), 30)
        assert gate.plan.chunks  # the base request's row is in the parked step
        await engine.add_adapter("sql", f"file://{new_dir}")  # supersedes v_old ...
        doomed.cancel()  # ... whose last request leaves while its slot is being written
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert v_old not in engine.testing.adapters.registry.versions()
        gate.release()
        tokens, _, outs = await asyncio.wait_for(base, 30)
        assert outs[-1].finish_reason == "length" and len(tokens) == long.max_tokens
        assert engine.stats()["errors"] == 0
        assert not engine._loop_task.done()
        new_tokens, _, _ = await collect(engine, PROMPT, short, adapter="sql")
        assert_idle(engine)
    hf = HFReference(model_dir, {"new": new_dir})
    compare(new_tokens, *hf.greedy(PROMPT, "new", short.max_tokens))


async def test_pin_follows_the_name_across_a_reload(tiny, tmp_path):
    """The operator pins a name; re-adding the name with new content keeps it pinned."""
    model_dir, adapters = tiny
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    new_sql = derived_adapter(adapters["sql"], tmp_path / "sql2", seed=4)
    async with AsyncEngine(config(model_dir, max_loras=2, max_cpu_loras=4)) as engine:
        for name in ("sql", "poem", "math", "chat"):
            await engine.add_adapter(name, f"file://{adapters[name]}")
        engine.pin_adapter("sql")
        await engine.add_adapter("sql", f"file://{new_sql}")
        for name in ("sql", "poem", "math", "chat", "poem"):
            await collect(engine, PROMPT, short, adapter=name)
            assert "sql" in engine.stats()["gpu_resident"], name
        assert_idle(engine)


async def test_reloading_a_pinned_name_waits_for_the_old_version_instead_of_failing(tiny, tmp_path):
    """One slot, pinned name: while the old version still streams in the slot, requests on the
    new version wait for it to drain (the old version's pin died with it), not SlotFullError."""
    model_dir, adapters = tiny
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    new_dir = derived_adapter(adapters["sql"], tmp_path / "sql2", seed=6)
    async with AsyncEngine(config(model_dir, max_loras=1, max_cpu_loras=2)) as engine:
        await engine.add_adapter("sql", f"file://{adapters['sql']}")
        engine.pin_adapter("sql")
        gate = StepGate(engine, lambda plan: any(c.req.output_ids for c in plan.chunks))
        old = asyncio.create_task(collect(engine, PROMPT, long, adapter="sql"))
        await asyncio.wait_for(gate.reached.wait(), 30)
        await engine.add_adapter("sql", f"file://{new_dir}")
        new = asyncio.create_task(collect(engine, PROMPT, short, adapter="sql"))
        await asyncio.sleep(0)
        gate.release()
        (old_tokens, _, _), (new_tokens, _, _) = await asyncio.wait_for(
            asyncio.gather(old, new), 30
        )
        assert engine.stats()["gpu_resident"] == ["sql"]
        assert engine.testing.adapters.registry.get("sql").pinned
        assert_idle(engine)
    hf = HFReference(model_dir, {"old": adapters["sql"], "new": new_dir})
    compare(old_tokens, *hf.greedy(PROMPT, "old", long.max_tokens))
    compare(new_tokens, *hf.greedy(PROMPT, "new", short.max_tokens))
