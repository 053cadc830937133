"""The host pool and the staging directory under cold loads through loader processes: a
cancelled load gives its pool region back, an exhausted pool evicts idle CPU-tier versions,
the staging directory keeps to its byte quota (least recently used idle versions dropped,
fetched again when needed), and a re-fetch reads the version's pinned revision."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loraplex.engine import AsyncEngine
from loraplex.engine.adapters import loader_procs as loader_process
from loraplex.engine.adapters.registry import AdapterState
from loraplex.plugins import hookimpl
from loraplex.resolvers import AdapterSource, Report, Resolver, ResolverSettings, copy_file
from tests.helpers import slow_loader
from tests.helpers.lifecycle import (
    GREEDY,
    PROMPT,
    assert_idle,
    collect,
    config,
    derived_adapter,
    evict_cpu,
    pool_idle,
    proc_config,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


async def test_cancelled_load_releases_its_region(tiny, lib, tmp_path, monkeypatch):
    model_dir, _ = tiny
    monkeypatch.setattr(loader_process, "helper_command", slow_loader.command(delay=0.5))
    cfg = proc_config(model_dir, tmp_path)
    async with AsyncEngine(cfg) as engine:
        await engine.add_adapter("poem", str(lib["poem"]))
        evict_cpu(engine, "poem")  # its first request stages it (add_adapter's image dropped)
        procs = engine.testing.adapters.fetcher.procs
        task = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="poem"))
        await wait_until(lambda: any(p.jobs for p in procs.procs), "a stage job in flight")
        assert engine.testing.adapters.pool.in_use() == 1  # the region the helper packs into
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the helper is told; the region comes back once it says the job ended
        await wait_until(lambda: engine.testing.adapters.pool.in_use() == 0, "region released")
        assert not any(p.jobs for p in procs.procs)
        v = engine.testing.adapters.registry.get("poem")
        assert v.state is AdapterState.REGISTERED and v.region is None
        assert_idle(engine)
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert len(tokens) == GREEDY.max_tokens
        pool_idle(engine)


async def test_pool_exhaustion_evicts_idle_cpu_versions(tiny, lib, tmp_path):
    model_dir, _ = tiny
    # 2 slots, a CPU tier of 2, 1 load at a time: 3 regions for 4 adapters
    cfg = proc_config(model_dir, tmp_path, max_cpu_loras=2, max_concurrent_loads=1)
    async with AsyncEngine(cfg) as engine:
        assert engine.testing.adapters.pool.count == 3
        for name in lib:
            await engine.add_adapter(name, str(lib[name]))
        for _ in range(2):
            for name in lib:
                tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter=name)
                assert len(tokens) == GREEDY.max_tokens
                pool_idle(engine)
        assert engine.stats()["adapters"]["cpu_evictions"] > 0
        assert_idle(engine)


# -- the staging directory ------------------------------------------------------------------


async def test_staging_quota_evicts_idle_versions_and_refetches(tiny, lib, tmp_path):
    model_dir, _ = tiny
    one = sum(f.stat().st_size for f in lib["poem"].iterdir())
    cfg = proc_config(model_dir, tmp_path, adapter_cache_bytes=int(one * 1.2), max_cpu_loras=2)
    async with AsyncEngine(cfg) as engine:
        for name in ("sql", "poem", "math"):
            await engine.add_adapter(name, str(lib[name]))
            staged = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
            assert staged <= one * 1.2
        versions = {v.name: v for v in engine.testing.adapters.registry.versions()}
        assert versions["sql"].local_dir is None  # least recently used, dropped
        assert versions["math"].local_dir is not None
        evict_cpu(engine, "sql")  # the image add_adapter kept goes: its files are needed again
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="sql")  # fetched again
        assert len(tokens) == GREEDY.max_tokens
        assert versions["sql"].local_dir is not None
        assert_idle(engine)


class _RevSource(AdapterSource):
    def __init__(self, folder: Path, pinned: str) -> None:
        self.folder, self.pinned_uri = folder, pinned
        self.files = {p.name: p.stat().st_size for p in folder.iterdir()}

    async def download(self, name: str, target: Path, report: Report) -> None:
        await copy_file(self.folder / name, target, report)


class RevPlugin:
    """``rev://lib/<name>`` serves the newest revision of ``<name>`` (a moving branch),
    ``rev://lib/<name>@<k>`` revision k, like a Hub repo pinned to a commit."""

    def __init__(self) -> None:
        self.revs: dict[str, list[Path]] = {}
        self.opened: list[str] = []

    @hookimpl
    def loraplex_resolvers(self, settings: ResolverSettings) -> list[Resolver]:
        plugin = self

        class RevResolver(Resolver):
            schemes = ("rev",)

            async def open(self, uri: str) -> AdapterSource:
                plugin.opened.append(uri)
                name, _, k = uri.removeprefix("rev://lib/").partition("@")
                revs = plugin.revs[name]
                i = int(k) if k else len(revs) - 1
                return _RevSource(revs[i], f"rev://lib/{name}@{i}")

        return [RevResolver(settings)]


async def test_refetch_reads_the_pinned_revision(tiny, lib, tmp_path):
    model_dir, _ = tiny
    plugin = RevPlugin()
    plugin.revs["poem"] = [lib["poem"]]
    cfg = config(
        model_dir,
        max_cpu_loras=2,
        adapter_cache_bytes=1,  # keeps only the newest version's files
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    async with AsyncEngine(cfg) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "rev")
        info = await engine.add_adapter("poem", "rev://lib/poem")
        first, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        v = engine.testing.adapters.registry.get("poem")
        assert v.pinned_uri == "rev://lib/poem@0"
        # the branch moves on; two other adapters push poem out of the staging dir, its slot
        # and the CPU tier
        plugin.revs["poem"].append(derived_adapter(lib["poem"], tmp_path / "poem2", seed=3))
        for name in ("sql", "math"):
            await engine.add_adapter(name, str(lib[name]))
            await collect(engine, PROMPT, GREEDY, adapter=name)
        assert v.local_dir is None and v.adapter is None
        assert engine.testing.adapters.slots.slot_of(v) is None
        again, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert plugin.opened[-1] == "rev://lib/poem@0"
        assert again == first and v.digest == info["digest"]
        assert_idle(engine)
