"""The staging copy written after the pass (onepass.py's ``defer_copy``): the pass returns
before any of the copy's bytes is written, the copy is the bytes the pass hashed (also when
more chunks than are kept pass through), it is sealed only once whole, nothing reads it
before, a failed write leaves no copy and the adapter is fetched and verified again, and an
adapter whose DoRA magnitudes are read from the copy right after the pass gets it written in
the pass."""

from __future__ import annotations

import errno
import json
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from loraplex.engine import AsyncEngine, errors
from loraplex.engine.adapters import pass_chunks, pass_sinks
from loraplex.engine.adapters.onepass import PassSource, read_pass
from loraplex.engine.adapters.seal import Seal
from loraplex.engine.model.config import ModelConfig
from tests.helpers.adapters import make_dora_adapter
from tests.helpers.lifecycle import (
    GREEDY,
    PROMPT,
    assert_idle,
    collect,
    config,
    evict_cpu,
    wait_until,
)
from tests.helpers.peft_oracle import HFReference, compare

W = "adapter_model.safetensors"
C = "adapter_config.json"


def _mc(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))


def _pass(src_dir: Path, dst: Path, mc: ModelConfig, **kw):
    dst.mkdir()
    src = PassSource.open_dir(src_dir)
    try:
        return read_pass(
            src, mc, max_lora_rank=16, max_bytes=None, dtype=torch.float32, copy_to=dst,
            defer_copy=True, **kw,
        )  # fmt: skip
    finally:
        src.close()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 KiB (the tiny adapters span many), kept rings and spares of this test only."""
    monkeypatch.setattr(pass_chunks, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(pass_chunks, "_rings", [])
    monkeypatch.setattr(pass_chunks, "_spare", [])


@pytest.mark.parametrize("kept_chunks", [10_000, 8])  # all kept / the oldest written first
def test_the_deferred_copy_is_the_bytes_hashed_and_sealed_once_whole(
    tiny, tmp_path, monkeypatch, small_chunks, kept_chunks
):
    model_dir, adapters = tiny
    monkeypatch.setattr(pass_chunks, "RETAIN_BYTES", kept_chunks * 4096)
    runs = len(pass_chunks.runs_of(_tensors(adapters["poem"])))
    assert runs > 2 * pass_chunks.RING  # (the chunks pass the ring's size)
    gate = threading.Event()
    written = []
    real = pass_sinks._write

    def write(fd, data):
        if kept_chunks > runs:  # everything kept: no write may run before the pass returned
            assert gate.wait(30), "the pass waited for its copy"
        written.append(len(data))
        real(fd, data)

    monkeypatch.setattr(pass_sinks, "_write", write)
    dst = tmp_path / "copy"
    got = _pass(adapters["poem"], dst, _mc(model_dir))
    assert got.seal is None and isinstance(got.copy, Future)
    if kept_chunks > runs:  # (the writes wait for the gate: not renamed before they are done)
        assert not (dst / W).exists() and not got.copy.done()
    gate.set()
    seal = got.copy.result(timeout=60)
    assert isinstance(seal, Seal) and seal.digest == got.digest
    assert (dst / W).read_bytes() == (adapters["poem"] / W).read_bytes()
    assert (dst / C).read_bytes() == (adapters["poem"] / C).read_bytes()
    assert not list(dst.glob(".*.part"))
    seal.check_folder(dst)
    assert sum(written) == (adapters["poem"] / W).stat().st_size
    # the chunks went back for later passes: at most the kept bytes beyond the ring
    assert len(pass_chunks._spare) * 4096 <= pass_chunks.RETAIN_BYTES


def test_a_failed_pass_leaves_no_deferred_copy(tiny, tmp_path, small_chunks):
    model_dir, adapters = tiny

    def expect(digest: str) -> None:
        raise errors.AdapterDigestError("changed", field="sha256")

    dst = tmp_path / "copy"
    with pytest.raises(errors.AdapterDigestError):
        _pass(adapters["poem"], dst, _mc(model_dir), expect=expect)
    assert not (dst / W).exists() and not list(dst.glob(".*.part"))


def test_a_failed_write_fails_the_copy_not_the_load(tiny, tmp_path, monkeypatch, small_chunks):
    model_dir, adapters = tiny

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pass_sinks, "_write", full)
    dst = tmp_path / "copy"
    got = _pass(adapters["poem"], dst, _mc(model_dir))
    assert got.packed is not None and got.digest  # the pass itself succeeded
    with pytest.raises(OSError, match="No space"):
        got.copy.result(timeout=60)
    assert not (dst / W).exists() and not list(dst.glob(".*.part"))


def test_a_dora_adapter_gets_its_copy_in_the_pass(tiny, tmp_path):
    model_dir, _ = tiny
    dora = make_dora_adapter(model_dir, tmp_path / "dora", seed=3)
    got = _pass(dora, tmp_path / "copy", _mc(model_dir))
    assert got.copy is None and got.seal is not None and got.seal.digest == got.digest
    assert (tmp_path / "copy" / W).read_bytes() == (dora / W).read_bytes()


async def test_an_engine_reads_the_copy_only_once_sealed_and_refetches_after_a_failed_write(
    tiny, tmp_path, monkeypatch
):
    """In an engine (threads: the copy is deferred): a re-load from the CPU tier waits for
    the copy's seal; when the copy's write failed, the adapter is fetched and verified again
    from its source, and the tokens are PEFT's either way."""
    model_dir, adapters = tiny
    broken = [True]
    real = pass_sinks._write

    def write(fd, data):
        if broken[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(pass_sinks, "_write", write)
    cfg = config(model_dir, max_loras=1, max_cpu_loras=1, local_roots=(str(tmp_path),),
                 adapter_cache_dir=str(tmp_path / "cache"))  # fmt: skip
    src = tmp_path / "lib" / "poem"
    src.parent.mkdir()
    shutil.copytree(adapters["poem"], src)
    async with AsyncEngine(cfg) as engine:
        a = engine.testing.adapters
        await engine.add_adapter("poem", f"file://{src}")
        v = a.registry.get("poem")
        first, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        await a.copy_written(v)  # the write failed: the copy dropped
        assert v.seal is None and v.local_dir is None and v.copy is None
        broken[0] = False
        await wait_until(lambda: a.slots.refs(v) == 0, "the request let its slot go")
        a.slots.free(v)
        evict_cpu(engine, "poem")
        again, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert "fetch" in v.timings  # fetched and verified again
        await a.copy_written(v)
        assert v.seal is not None and v.seal.digest == v.digest
        assert (v.local_dir / W).read_bytes() == (src / W).read_bytes()
        # evicted again: the stage reads the sealed copy (no fetch)
        await wait_until(lambda: a.slots.refs(v) == 0, "the request let its slot go")
        a.slots.free(v)
        evict_cpu(engine, "poem")
        third, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert "stage" in v.timings and "fetch" not in v.timings
        assert_idle(engine)
    hf = HFReference(model_dir, {"poem": adapters["poem"]})
    ref = hf.greedy(PROMPT, "poem", GREEDY.max_tokens)
    for out in (first, again, third):
        compare(out, *ref)


def _tensors(folder: Path):
    from loraplex.engine.adapters.files import parse_safetensors_header

    raw = (folder / W).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return parse_safetensors_header(raw[8 : 8 + n], len(raw)).tensors


async def test_a_copy_still_being_written_is_neither_trimmed_nor_left_behind(
    tiny, tmp_path, monkeypatch
):
    """An adapter removed while its staging copy is still being written: its folder goes once
    the copy is done (not before, not never); an engine closed meanwhile waits for the copy
    before it removes its staging directory."""
    model_dir, adapters = tiny
    gate = threading.Event()
    real = pass_sinks._write

    def write(fd, data):
        assert gate.wait(30)
        real(fd, data)

    monkeypatch.setattr(pass_sinks, "_write", write)
    src = tmp_path / "lib" / "poem"
    shutil.copytree(adapters["poem"], src)
    cfg = config(model_dir, local_roots=(str(tmp_path / "lib"),))
    async with AsyncEngine(cfg) as engine:
        a = engine.testing.adapters
        await engine.add_adapter("poem", f"file://{src}")
        v = a.registry.get("poem")
        folder, copy = v.local_dir, v.copy
        assert copy is not None and not copy.done() and folder.is_dir()
        await engine.remove_adapter("poem")
        assert folder.is_dir()  # (the writer still writes into it)
        gate.set()
        await wait_until(lambda: not folder.exists(), "the removed adapter's folder goes")
        gate.clear()
        await engine.add_adapter("poem2", f"file://{src}")
        v2 = a.registry.get("poem2")
        cache = v2.local_dir.parent
        threading.Timer(0.5, gate.set).start()  # the copy lands while the engine closes
    assert v2.copy.done() and v2.copy.exception() is None
    assert not cache.exists() or not any(cache.iterdir())
