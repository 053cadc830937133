"""Hostile adapters against a running engine (the demo model, CPU): each fails with its typed
error, only for whoever asked for it, while another stream keeps decoding; afterwards the engine
serves an identical greedy completion and every refcount and KV block is back to zero.

- garbage weights (NaN, Inf, 3e38) on a dynamic adapter: AdapterValueError for its request
- adapter_config.json nested 100k levels: AdapterConfigError at start-up (``trusted``, as
  ``--lora-modules``) and at runtime load (``trusted=False``, as the admin route)
- ``"target_modules": "(.*){8}z"`` (ReDoS, ~24 s per module name in ``re``): refused at once,
  and the other stream's inter-token gap stays small while it is tried
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
from loraplex.engine.demo import demo_adapters
from loraplex.engine.errors import AdapterConfigError, AdapterValueError
from tests.helpers.engine import assert_idle, collect

W, C = "adapter_model.safetensors", "adapter_config.json"
PROMPT = [5, 17, 33, 9, 61, 12]
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
STALL_S = 1.0  # an inter-token gap this long means decoding stopped


def _config(root: Path, tmp_path: Path, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        model=None,
        device="cpu",
        dtype="float32",
        max_loras=2,
        max_cpu_loras=2,
        local_roots=(str(root),),
        lora_name_template=f"file://{root}/{{name}}",
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    base.update(kw)
    return EngineConfig(**base)


def _poisoned(dst: Path, value: float) -> Path:
    shutil.copytree(demo_adapters()["sql"], dst)
    tensors = load_file(dst / W)
    key = sorted(k for k in tensors if ".lora_B." in k)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = value
    save_file(tensors, str(dst / W))
    return dst


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    shutil.copytree(demo_adapters()["sql"], r / "good")
    return r


async def test_garbage_weights_fail_only_their_requests(root: Path, tmp_path: Path) -> None:
    poisons = {"nan": float("nan"), "inf": float("inf"), "huge": 3e38}
    for name, value in poisons.items():
        _poisoned(root / name, value)
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(_config(root, tmp_path)) as engine:
        before = await collect(engine, PROMPT, SHORT, adapter="good")

        async def failing(name: str) -> BaseException:
            with pytest.raises(AdapterValueError) as ei:
                await collect(engine, PROMPT, SHORT, adapter=name)
            return ei.value

        base, *errors = await asyncio.gather(
            collect(engine, PROMPT, long), *(failing(n) for n in poisons)
        )
        assert len(base[0]) == long.max_tokens
        for name, err in zip(poisons, errors, strict=True):
            assert ".lora_B." in str(err.field), (name, err)
        assert engine.stats()["adapters"]["load_failures"] == len(poisons)
        # the engine keeps serving: the same greedy completion as before, nothing held
        assert (await collect(engine, PROMPT, SHORT, adapter="good"))[0] == before[0]
        assert_idle(engine)
        assert sorted(a["name"] for a in engine.list_adapters()) == ["good"]


@pytest.mark.parametrize("trusted", [True, False], ids=["startup", "admin"])
async def test_nested_config_is_a_typed_error(root: Path, tmp_path: Path, trusted: bool) -> None:
    bad = root / "nested"
    shutil.copytree(demo_adapters()["sql"], bad)
    depth = 100_000
    (bad / C).write_bytes(b'{"peft_type": "LORA", "r": ' + b"[" * depth + b"]" * depth + b"}")
    async with AsyncEngine(_config(root, tmp_path)) as engine:
        before = await collect(engine, PROMPT, SHORT)
        with pytest.raises(AdapterConfigError, match="nested too deeply"):
            await engine.add_adapter("nested", f"file://{bad}", trusted=trusted)
        with pytest.raises(AdapterConfigError):  # the same file as a dynamic name
            await collect(engine, PROMPT, SHORT, adapter="nested")
        assert (await collect(engine, PROMPT, SHORT))[0] == before[0]
        assert_idle(engine)


async def _stream_times(engine: AsyncEngine, params: SamplingParams, times: list[float]) -> None:
    async for _ in engine.generate(PROMPT, params):
        times.append(time.perf_counter())


def _worst_gap(times: list[float], start: float, end: float) -> float:
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b >= start and a <= end]
    return max(gaps, default=0.0)


async def test_redos_config_is_refused_while_another_stream_decodes(
    root: Path, tmp_path: Path
) -> None:
    hostile = root / "redos"
    shutil.copytree(demo_adapters()["sql"], hostile)
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 32, "target_modules": "(.*){8}z"}
    (hostile / C).write_text(json.dumps(cfg))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(_config(root, tmp_path)) as engine:
        times: list[float] = []
        stream = asyncio.create_task(_stream_times(engine, params, times))
        while len(times) < 12:  # decoding at a steady pace first
            await asyncio.sleep(0.005)
            assert not stream.done()
        quiet = _worst_gap(times, times[3], times[-1])
        t0 = time.perf_counter()
        # NOTE: wait_for only turns a regression (minutes in re) into a failure, not a hang
        with pytest.raises(AdapterConfigError, match="target_modules"):
            add = engine.add_adapter("redos", f"file://{hostile}", trusted=False)
            await asyncio.wait_for(add, 60)
        with pytest.raises(AdapterConfigError, match="target_modules"):  # as a dynamic name
            await asyncio.wait_for(collect(engine, PROMPT, SHORT, adapter="redos"), 60)
        t1 = time.perf_counter()
        n_during = len(times)
        await stream
        assert len(times) == params.max_tokens
        assert n_during < params.max_tokens, "the attack ended after the stream: no overlap"
        worst = _worst_gap(times, t0, t1)
        print(
            f"inter-token gap: worst {worst * 1e3:.0f} ms while refusing, {quiet * 1e3:.0f} ms quiet"
        )
        # NOTE: a stall detector, not a speed figure (tests do not assert on wall-clock time;
        # the 100 ms bar is measured by the soak benchmark): before the fix the
        # stream stopped for ~24 s; a loaded shared CPU makes quiet gaps alone exceed 100 ms
        assert worst < max(STALL_S, 5 * quiet), (worst, quiet)
        assert_idle(engine)
