"""The sealed staging copy (adapters/seal.py): a re-load from the engine's own staging copy
hashes nothing while the copy is provably the verified one; a copy changed on disk (one byte,
same size, mtime put back) is never read into a slot: the engine fetches and verifies the
source again, or fails typed when the source changed too."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

from loraplex.engine import AsyncEngine, errors
from loraplex.engine.adapters import onepass
from loraplex.engine.adapters.onepass import PassSource, read_pass
from loraplex.engine.adapters.registry import AdapterState
from loraplex.engine.adapters.staging import stage_file
from loraplex.engine.model.config import ModelConfig
from tests.helpers.lifecycle import (
    GREEDY,
    PROMPT,
    HeldPlugin,
    assert_idle,
    collect,
    config,
    evict_cpu,
    pool_idle,
    proc_config,
    staged_leftovers,
    wait_until,
)
from tests.helpers.peft_oracle import HFReference, compare

pytestmark = pytest.mark.timeout(120)

W = "adapter_model.safetensors"


def tamper(folder: Path) -> None:
    """Flip a low bit of one data byte of the weights file, keeping its size and putting its
    mtime back (what a check of size + mtime alone would miss). Waits past the filesystem's
    timestamp tick first, so the change is a new ctime."""
    path = folder / W
    st = path.stat()
    time.sleep(0.05)
    os.chmod(path, 0o644)  # (the copy is read-only; root could write it anyway)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    raw[(8 + n + len(raw)) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    os.chmod(path, st.st_mode)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def _staged(src: Path, dst: Path, mc: ModelConfig):
    """A verified staging copy of ``src`` made by the pass, and the pass's result."""
    dst.mkdir()
    s = PassSource.open_dir(src)
    try:
        return read_pass(s, mc, max_lora_rank=16, max_bytes=None, copy_to=dst)
    finally:
        s.close()


def test_the_pass_seals_its_copy_and_a_changed_copy_is_refused(tiny, tmp_path):
    model_dir, adapters = tiny
    mc = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    got = _staged(adapters["sql"], tmp_path / "copy", mc)
    seal = got.seal
    assert seal is not None and seal.digest == got.digest
    for name in ("adapter_config.json", W):
        assert stat.S_IMODE((tmp_path / "copy" / name).stat().st_mode) == 0o444
    kw = dict(dtype=torch.float32, seal=seal)
    good = stage_file(tmp_path / "copy", mc, 16, **kw)
    ref = stage_file(adapters["sql"], mc, 16, dtype=torch.float32)
    assert torch.equal(good.image.buffer, ref.image.buffer)
    tamper(tmp_path / "copy")
    with pytest.raises(errors.StagedCopyChangedError, match="ctime"):
        stage_file(tmp_path / "copy", mc, 16, **kw)
    # without a seal, the version's digest: the copy is hashed and refused the same way
    with pytest.raises(errors.StagedCopyChangedError, match="digest"):
        stage_file(tmp_path / "copy", mc, 16, dtype=torch.float32, expect_digest=got.digest)


def test_a_copy_changed_while_the_stage_reads_it_is_refused(tiny, tmp_path, monkeypatch):
    """The seal is checked on the open files after the pass as well: a change after the first
    check (while the stage runs) fails the stage, whose image the caller then gives back."""
    model_dir, adapters = tiny
    mc = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    got = _staged(adapters["sql"], tmp_path / "copy", mc)
    real = onepass._data_pass

    def changing(*a, **kw):
        tamper(tmp_path / "copy")
        return real(*a, **kw)

    monkeypatch.setattr(onepass, "_data_pass", changing)
    with pytest.raises(errors.StagedCopyChangedError):
        stage_file(tmp_path / "copy", mc, 16, dtype=torch.float32, seal=got.seal)


def _engine_config(model_dir, tmp_path, procs: int, **kw):
    kw.setdefault("adapter_cache_dir", str(tmp_path / "cache"))
    return proc_config(model_dir, tmp_path, **kw) if procs else config(model_dir, **kw)


@pytest.mark.parametrize("procs", [0, 1])
async def test_reload_from_an_intact_copy_hashes_nothing_and_a_changed_one_is_refetched(
    tiny, tmp_path, procs
):
    model_dir, adapters = tiny
    src = tmp_path / "src" / "poem"
    shutil.copytree(adapters["poem"], src)
    async with AsyncEngine(_engine_config(model_dir, tmp_path, procs)) as engine:
        a = engine.testing.adapters
        await engine.add_adapter("poem", f"file://{src}")
        v = a.registry.get("poem")
        await a.copy_written(v)  # (in this process: written after the load's pass)
        first_dir, seal = v.local_dir, v.seal
        assert seal is not None and seal.digest == v.digest
        # evicted, then read back from the intact copy: a stage, no fetch
        evict_cpu(engine, "poem")
        intact, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert "stage" in v.timings and "fetch" not in v.timings and v.local_dir == first_dir
        await wait_until(lambda: a.slots.refs(v) == 0, "the request let its slot go")
        a.slots.free(v)  # (out of its GPU slot, so that it can leave the CPU tier)
        evict_cpu(engine, "poem")
        tamper(first_dir)
        changed, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert "fetch" in v.timings and v.local_dir != first_dir  # fetched and verified again
        await a.copy_written(v)
        assert v.digest == seal.digest and v.seal is not None and v.seal != seal
        # the image the request read is the source's, bit for bit (not the changed copy's)
        mc = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
        ref = stage_file(adapters["poem"], mc, 16, dtype=torch.float32).image.buffer
        assert torch.equal(v.adapter.image.buffer[: ref.numel()], ref)
        await wait_until(lambda: not first_dir.exists(), "the changed copy removed")
        assert_idle(engine)
        if a.pool is not None:
            pool_idle(engine)
    hf = HFReference(model_dir, {"poem": adapters["poem"]})
    ref = hf.greedy(PROMPT, "poem", GREEDY.max_tokens)
    compare(intact, *ref)
    compare(changed, *ref)


@pytest.mark.parametrize("procs", [0, 1])
async def test_changed_copy_and_changed_source_fail_typed_and_no_slot_reads_them(
    tiny, tmp_path, procs
):
    model_dir, adapters = tiny
    src = tmp_path / "src" / "poem"
    shutil.copytree(adapters["poem"], src)
    async with AsyncEngine(_engine_config(model_dir, tmp_path, procs)) as engine:
        a = engine.testing.adapters
        await engine.add_adapter("poem", f"file://{src}")
        v = a.registry.get("poem")
        await a.copy_written(v)  # (in this process: written after the load's pass)
        evict_cpu(engine, "poem")
        tamper(v.local_dir)
        tamper(src)

        async def refused() -> None:
            with pytest.raises(errors.AdapterDigestError, match="changed"):
                await collect(engine, PROMPT, GREEDY, adapter="poem")

        base, _ = await asyncio.gather(collect(engine, PROMPT, GREEDY), refused())
        assert len(base[0]) == GREEDY.max_tokens
        assert a.slots.slot_of(v) is None and v.adapter is None and v.region is None
        assert v.state is not AdapterState.CPU
        assert_idle(engine)
        await wait_until(lambda: not staged_leftovers(engine), "no staged file kept")
        if a.pool is not None:
            pool_idle(engine)


async def test_a_downloaded_copy_is_sealed_before_the_pass_reads_it(tiny, tmp_path):
    """A source the engine downloads (a plugin resolver's): the download is sealed, then
    verified by the pass; a change afterwards is refetched the same way."""
    model_dir, adapters = tiny
    plugin = HeldPlugin({"chat": adapters["chat"]}, open_gate=True)
    cfg = config(
        model_dir,
        lora_name_template="held://lib/{name}",
        allow_sources=("held://lib/*",),
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    async with AsyncEngine(cfg) as engine:
        engine.testing.adapters.fetcher.plugins.register(plugin, "held")
        first, _, _ = await collect(engine, PROMPT, GREEDY, adapter="chat")
        v = engine.testing.adapters.registry.get("chat")
        assert v.seal is not None and v.seal.digest == v.digest
        assert stat.S_IMODE((v.local_dir / W).stat().st_mode) == 0o444
        await wait_until(lambda: engine.testing.adapters.slots.refs(v) == 0, "slot let go")
        engine.testing.adapters.slots.free(v)
        evict_cpu(engine, "chat")
        tamper(v.local_dir)
        again, _, _ = await collect(engine, PROMPT, GREEDY, adapter="chat")
        assert plugin.opens == ["chat", "chat"]
        assert_idle(engine)
    hf = HFReference(model_dir, {"chat": adapters["chat"]})
    ref = hf.greedy(PROMPT, "chat", GREEDY.max_tokens)
    compare(first, *ref)
    compare(again, *ref)
