"""One pass per byte (adapters/onepass.py, fetch_pass.py): a corrupt byte anywhere in the weights
file is caught before anything the pass wrote is usable, the image is the parser's bit for bit,
and in an engine a load that fails its digest or value check leaves no slot or region in use
while the next good load works."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from loraplex.engine import AsyncEngine, errors
from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.adapters.onepass import PassSource, read_pass
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.adapters.staging import stage_packed
from loraplex.engine.model.config import ModelConfig
from tests.helpers.lifecycle import (
    GREEDY,
    PROMPT,
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

W = "adapter_model.safetensors"
R = 64


def _mc(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))


def _corrupt(src: Path, dst: Path, where: str) -> None:
    """A copy of ``src`` with one byte flipped: in the header's JSON (a digit of an offset:
    still valid JSON), or in the data section at its start, middle or end."""
    shutil.copytree(src, dst)
    raw = bytearray((dst / W).read_bytes())
    n = int.from_bytes(raw[:8], "little")
    if where == "header":
        at = 8 + raw[8 : 8 + n].index(b'"shape":[') + len('"shape":[')
        raw[at] = ord("9") if raw[at] != ord("9") else ord("8")
    else:
        lo, hi = 8 + n, len(raw) - 1
        at = {"start": lo, "middle": (lo + hi) // 2, "end": hi}[where]
        raw[at] ^= 0x01  # a low mantissa bit: the values stay finite and small
    (dst / W).write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["header", "start", "middle", "end"])
def test_a_corrupt_byte_anywhere_fails_the_pass_and_keeps_no_copy(tiny, tmp_path, where):
    model_dir, adapters = tiny
    good = adapter_digest(adapters["sql"])
    bad = tmp_path / "bad"
    _corrupt(adapters["sql"], bad, where)
    copy = tmp_path / "copy"
    copy.mkdir()

    def expect(digest: str) -> None:
        if digest != good:
            raise errors.AdapterDigestError("changed", field="sha256")

    src = PassSource.open_dir(bad)
    try:
        with pytest.raises((errors.AdapterDigestError, errors.AdapterFormatError,
                            errors.AdapterShapeError)):  # fmt: skip
            read_pass(src, _mc(model_dir), max_lora_rank=R, max_bytes=None,
                      dtype=torch.float32, copy_to=copy, expect=expect)  # fmt: skip
    finally:
        src.close()
    assert not (copy / W).exists() and not (copy / f".{W}.part").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pass_packs_the_parsers_image_and_the_digest(tiny, tmp_path, dtype):
    model_dir, adapters = tiny
    mc = _mc(model_dir)
    src = PassSource.open_dir(adapters["sql"])
    try:
        got = read_pass(src, mc, max_lora_rank=R, max_bytes=None, dtype=dtype,
                        copy_to=tmp_path)  # fmt: skip
    finally:
        src.close()
    assert got.digest == adapter_digest(adapters["sql"]) == adapter_digest(tmp_path)
    ref = stage_packed(
        load_adapter(adapters["sql"], mc, max_lora_rank=R, dtype=dtype), R, pin=False
    )
    assert got.packed is not None and got.packed.entries == ref.entries
    assert torch.equal(got.packed.buffer.view(torch.uint8), ref.buffer.view(torch.uint8))


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_pass_packs_half_precision_files_into_a_region_view(tiny, tmp_path, file_dtype, dtype):
    """Adapter files in bf16 / fp16 (as PEFT saves them for a GPU engine), packed into a view
    that starts inside a larger buffer (a host-pool region): the image is the parser's bit for
    bit, whether its dtype is the file's (copied as words) or another (converted), and not one
    element outside the view is written."""
    from safetensors.torch import load_file, save_file

    model_dir, adapters = tiny
    mc = _mc(model_dir)
    folder = tmp_path / "half"
    shutil.copytree(adapters["sql"], folder)
    tensors = {k: v.to(file_dtype) for k, v in load_file(folder / W).items()}
    save_file(tensors, folder / W)
    ref = stage_packed(load_adapter(folder, mc, max_lora_rank=R, dtype=dtype), R, pin=False)
    pool = torch.full((ref.buffer.numel() + 96,), 7.0, dtype=dtype)
    out = pool[40 : 40 + ref.buffer.numel()]
    src = PassSource.open_dir(folder)
    try:
        got = read_pass(src, mc, max_lora_rank=R, max_bytes=None, dtype=dtype, out=out)
    finally:
        src.close()
    assert got.packed is not None and got.packed.entries == ref.entries
    assert got.packed.buffer.data_ptr() == out.data_ptr()
    assert torch.equal(out.view(torch.uint8), ref.buffer.view(torch.uint8))
    assert torch.all(pool[:40] == 7.0) and torch.all(pool[40 + ref.buffer.numel() :] == 7.0)


@pytest.mark.parametrize("procs", [0, 1])
async def test_a_refetch_that_fails_its_digest_leaves_no_slot_and_the_next_load_works(
    tiny, tmp_path, procs
):
    """A registered adapter whose staged copy went is fetched, verified and staged again in one
    pass; its source changed by one byte: the request fails typed, no slot, region or staged
    file stays in use, decoding goes on, and a good adapter loads next (PEFT's tokens)."""
    model_dir, adapters = tiny
    root = tmp_path / "root"
    shutil.copytree(adapters["sql"], root / "sql")
    shutil.copytree(adapters["poem"], root / "poem")
    kw = dict(adapter_cache_dir=str(tmp_path / "cache"), max_cpu_loras=2)
    cfg = proc_config(model_dir, tmp_path, **kw) if procs else config(model_dir, **kw)
    async with AsyncEngine(cfg) as engine:
        a = engine.testing.adapters
        await engine.add_adapter("poem", f"file://{root / 'poem'}")
        await a.copy_written(a.registry.get("poem"))  # (in threads: written after the pass)
        evict_cpu(engine, "poem")  # (add_adapter's pass keeps its image: not loaded now)
        shutil.rmtree(a.registry.get("poem").local_dir)
        shutil.rmtree(root / "poem")
        _corrupt(adapters["poem"], root / "poem", "middle")

        async def refused() -> None:
            with pytest.raises(errors.AdapterDigestError, match="changed"):
                await collect(engine, PROMPT, GREEDY, adapter="poem")

        base, _ = await asyncio.gather(collect(engine, PROMPT, GREEDY), refused())
        assert len(base[0]) == GREEDY.max_tokens
        v = a.registry.get("poem")
        assert a.slots.slot_of(v) is None and v.region is None and v.adapter is None
        if a.pool is not None:
            pool_idle(engine)
        await engine.add_adapter("sql", f"file://{root / 'sql'}")
        sql, _, _ = await collect(engine, PROMPT, GREEDY, adapter="sql")
        assert_idle(engine)
        await wait_until(lambda: not staged_leftovers(engine), "failed load's files removed")
    hf = HFReference(model_dir, {"sql": adapters["sql"]})
    compare(sql, *hf.greedy(PROMPT, "sql", GREEDY.max_tokens))


def _pass(folder: Path, mc: ModelConfig, **kw):
    src = PassSource.open_dir(folder)
    try:
        return read_pass(src, mc, max_lora_rank=R, max_bytes=None, dtype=torch.float32, **kw)
    finally:
        src.close()


def _poison_data(src: Path, dst: Path, value: float) -> None:
    """A copy of ``src`` whose first data element is ``value`` (the header is unchanged)."""
    from safetensors import safe_open

    shutil.copytree(src, dst)
    raw = bytearray((dst / W).read_bytes())
    n = int.from_bytes(raw[:8], "little")
    with safe_open(str(src / W), "pt") as f:
        key = sorted(f.keys())[0]
        dtype = f.get_tensor(key).dtype
    header = json.loads(raw[8 : 8 + n])
    lo = 8 + n + min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    one = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    raw[lo : lo + len(one)] = one
    (dst / W).write_bytes(bytes(raw))


def test_a_header_checked_before_skips_its_checks_but_never_the_datas(tiny, tmp_path, monkeypatch):
    """Adapters of one shape have byte-identical headers: the second pass takes the checked
    header's result (check_header runs once) and packs the same image, while every value check
    and the digest still run on its own data: a NaN or a flipped byte behind the same header
    fails. Another rank limit or another base checks the header again."""
    from loraplex.engine.adapters import onepass

    model_dir, adapters = tiny
    mc = _mc(model_dir)
    monkeypatch.setattr(onepass, "_HEADERS", onepass._HeaderMemo(4))
    calls = []
    real = onepass.check_header
    monkeypatch.setattr(onepass, "check_header", lambda *a: calls.append(1) or real(*a))
    first = _pass(adapters["sql"], mc)
    again = _pass(adapters["sql"], mc)
    assert len(calls) == 1
    assert again.digest == first.digest and again.report is first.report
    assert torch.equal(again.packed.buffer, first.packed.buffer)

    _poison_data(adapters["sql"], tmp_path / "nan", float("nan"))
    with pytest.raises(errors.AdapterValueError, match="NaN"):
        _pass(tmp_path / "nan", mc)
    _corrupt(adapters["sql"], tmp_path / "flip", "middle")
    good = first.digest

    def expect(digest: str) -> None:
        if digest != good:
            raise errors.AdapterDigestError("changed", field="sha256")

    with pytest.raises(errors.AdapterDigestError):
        _pass(tmp_path / "flip", mc, expect=expect)
    assert len(calls) == 1  # (the same header each time)

    src = PassSource.open_dir(adapters["sql"])
    try:
        read_pass(src, mc, max_lora_rank=R // 2, max_bytes=None, dtype=torch.float32)
    finally:
        src.close()
    _pass(
        adapters["sql"], ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    )
    assert len(calls) == 3


@pytest.mark.parametrize("reserved", [True, False])
def test_the_copy_is_reserved_up_front_and_holds_exactly_the_bytes(tmp_path, monkeypatch, reserved):
    """The staging copy's blocks are allocated before its writes (fallocate); where the
    filesystem cannot, the writes allocate them: either way the copy is the bytes fed."""
    from loraplex.engine.adapters import pass_sinks

    if not reserved:
        monkeypatch.setattr(pass_sinks, "_fallocate", lambda *a: -1)
    data = bytes(range(256)) * 4096  # 1 MiB
    h = pass_sinks.Hasher(tmp_path, True, len(data) + 5)
    part = tmp_path / f".{W}.part"
    if reserved:
        assert part.stat().st_blocks * 512 >= len(data) + 5
    for f in h.feed(b"head!") + h.feed(data):
        f.result()
    assert h.finish() == hashlib.sha256(b"head!" + data).hexdigest()
    h.close(True)
    assert part.read_bytes() == b"head!" + data
