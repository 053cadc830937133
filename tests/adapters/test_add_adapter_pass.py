"""add_adapter then a first request, one pass: add_adapter's pass packs the slot image and the
version joins the CPU tier (within max_cpu_loras, by the tier's policy), so its first request
only writes a slot; outputs equal HF PEFT's."""

from __future__ import annotations

import asyncio
import os

import pytest

from loraplex.engine import AsyncEngine, errors
from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.registry import AdapterState
from tests.helpers.lifecycle import (
    GREEDY,
    PROMPT,
    assert_idle,
    collect,
    config,
    pool_idle,
    proc_config,
    truncated,
)
from tests.helpers.peft_oracle import HFReference, compare

pytestmark = pytest.mark.timeout(120)


def _config(model_dir, tmp_path, procs: int, **kw):
    kw.setdefault("adapter_cache_dir", str(tmp_path / "cache"))
    return proc_config(model_dir, tmp_path, **kw) if procs else config(model_dir, **kw)


def _count_stages(engine) -> list[str]:
    """Names of the versions the stager stages from their staged copy (a first request's
    load) from now on."""
    stager = engine.testing.adapters.stager
    staged: list[str] = []
    stage = stager.stage

    async def counting(v, *a, **kw):
        staged.append(v.name)
        return await stage(v, *a, **kw)

    stager.stage = counting
    return staged


def test_a_prefaulted_pool_has_every_page_backed_at_once():
    """A CPU engine's pool is pre-faulted: its memfd holds every page before any load (a
    pack into fresh pages costs a page fault per 4 KiB); without it no page is backed yet."""
    for prefault in (False, True):
        pool = HostPool(3 << 20, 2, prefault=prefault)
        try:
            backed = os.fstat(pool.fd).st_blocks * 512
            assert backed >= pool.nbytes if prefault else backed == 0
        finally:
            pool.close()


async def test_a_cpu_engine_packs_into_its_prefaulted_host_pool(tiny, tmp_path):
    """Every engine with LoRA slots has a host pool, the CPU engine without loader processes
    too: add_adapter's pass packs into one of its regions, whose pages exist from start-up."""
    model_dir, adapters = tiny
    async with AsyncEngine(_config(model_dir, tmp_path, 0)) as engine:
        a = engine.testing.adapters
        assert a.pool is not None and engine.testing.adapters.fetcher.procs is None
        assert os.fstat(a.pool.fd).st_blocks * 512 >= a.pool.nbytes
        await engine.add_adapter("sql", str(adapters["sql"]))
        assert a.registry.get("sql").region is not None


@pytest.mark.parametrize("procs", [0, 1])
async def test_added_adapter_is_cpu_resident_and_its_first_request_runs_no_stage(
    tiny, tmp_path, procs
):
    model_dir, adapters = tiny
    events: list[tuple[str, dict]] = []
    async with AsyncEngine(_config(model_dir, tmp_path, procs)) as engine:
        engine.subscribe(lambda e, d: events.append((e, d)))
        a = engine.testing.adapters
        staged = _count_stages(engine)
        for name in ("poem", "sql"):
            await engine.add_adapter(name, str(adapters[name]))
            v = a.registry.get(name)
            assert v.state is AdapterState.CPU and v.adapter is not None, v
            assert "stage" in v.timings and "verify" in v.timings
            assert (v.region is not None) == (a.pool is not None)
        loads = [d for e, d in events if e == "adapter_load"]
        assert [d["name"] for d in loads] == ["poem", "sql"] and all(d["ok"] for d in loads)
        poem, sql = await asyncio.gather(
            collect(engine, PROMPT, GREEDY, adapter="poem"),
            collect(engine, PROMPT, GREEDY, adapter="sql"),
        )
        stats = engine.stats()["adapters"]
        assert staged == [] and stats["loads"] == 0, (staged, stats)
        assert stats["cpu_hits"] == 2 and stats["misses"] == 0, stats
        assert len([e for e, _ in events if e == "adapter_load"]) == 2  # no load at the request
        assert_idle(engine)
        if a.pool is not None:
            pool_idle(engine)
    hf = HFReference(model_dir, {n: adapters[n] for n in ("poem", "sql")})
    compare(poem[0], *hf.greedy(PROMPT, "poem", GREEDY.max_tokens))
    compare(sql[0], *hf.greedy(PROMPT, "sql", GREEDY.max_tokens))


@pytest.mark.parametrize("procs", [0, 1])
async def test_added_adapters_stay_within_max_cpu_loras(tiny, tmp_path, procs):
    """Three adds into a CPU tier of two: the first two keep their images, the third is not
    packed (registering never evicts a loaded adapter: many registrations into a small tier
    would pack and throw away all but the last); its first request stages it from the
    verified staging copy."""
    model_dir, adapters = tiny
    names = ("poem", "sql", "math")
    cfg = _config(model_dir, tmp_path, procs, max_cpu_loras=2)
    async with AsyncEngine(cfg) as engine:
        a = engine.testing.adapters
        staged = _count_stages(engine)
        for name in names:
            await engine.add_adapter(name, str(adapters[name]))
        states = {n: a.registry.get(n).state for n in names}
        assert states == {
            "poem": AdapterState.CPU,
            "sql": AdapterState.CPU,
            "math": AdapterState.REGISTERED,
        }
        assert a.registry.get("math").region is None
        assert engine.stats()["adapters"]["cpu_evictions"] == 0
        if a.pool is not None:
            pool_idle(engine)
        outs = {}
        for name in names:
            outs[name], _, _ = await collect(engine, PROMPT, GREEDY, adapter=name)
        assert staged[0] == "math"  # (the others may be evicted by its load meanwhile)
        assert_idle(engine)
    hf = HFReference(model_dir, {n: adapters[n] for n in names})
    for name in names:
        compare(outs[name], *hf.greedy(PROMPT, name, GREEDY.max_tokens))


async def test_add_without_a_free_region_keeps_no_image(tiny, tmp_path):
    """add_adapter neither waits for host memory nor evicts for it: with no region free, its
    pass only checks, and the first request stages the adapter."""
    model_dir, adapters = tiny
    async with AsyncEngine(_config(model_dir, tmp_path, 1)) as engine:
        a = engine.testing.adapters
        acquire = a.pool.acquire
        a.pool.acquire = lambda: None
        await engine.add_adapter("poem", str(adapters["poem"]))
        v = a.registry.get("poem")
        assert v.state is AdapterState.REGISTERED and v.region is None and v.adapter is None
        a.pool.acquire = acquire
        staged = _count_stages(engine)
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert staged == ["poem"]
        assert_idle(engine)
        pool_idle(engine)
    hf = HFReference(model_dir, {"poem": adapters["poem"]})
    compare(tokens, *hf.greedy(PROMPT, "poem", GREEDY.max_tokens))


@pytest.mark.parametrize("procs", [0, 1])
async def test_a_failed_or_repeated_add_keeps_no_region(tiny, tmp_path, procs):
    """A corrupt adapter's add fails typed and keeps no image; adding the same content again
    returns the version already resident and gives the second image back."""
    model_dir, adapters = tiny
    bad = truncated(adapters["sql"], tmp_path / "bad")
    async with AsyncEngine(_config(model_dir, tmp_path, procs)) as engine:
        a = engine.testing.adapters
        with pytest.raises(errors.LoRAError):
            await engine.add_adapter("bad", str(bad))
        assert "bad" not in a.registry.names()
        first = await engine.add_adapter("poem", str(adapters["poem"]))
        again = await engine.add_adapter("poem", str(adapters["poem"]))
        assert again == first
        resident = [v for v in a.registry.versions() if v.state is AdapterState.CPU]
        assert [v.name for v in resident] == ["poem"]
        if a.pool is not None:
            pool_idle(engine)
            assert a.pool.in_use() == 1
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert_idle(engine)
    hf = HFReference(model_dir, {"poem": adapters["poem"]})
    compare(tokens, *hf.greedy(PROMPT, "poem", GREEDY.max_tokens))
