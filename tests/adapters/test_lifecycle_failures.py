"""Adapter lifecycle, failures: every broken adapter fails only its own requests with a typed
error, while a base request and a request on a good adapter run at the same time."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from loraplex.engine import AsyncEngine, SamplingParams, errors
from loraplex.engine.errors import InvalidRequestError
from tests.helpers.lifecycle import (
    BROKEN,
    NamePlugin,
    assert_idle,
    collect,
    config,
    derived_adapter,
    evict_cpu,
    staged_leftovers,
    wait_until,
)
from tests.helpers.peft_oracle import HFReference, compare

PROMPT = [9, 31, 4, 120, 66, 8]
LONG = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def test_broken_adapters_fail_only_their_requests(tiny, tmp_path):
    model_dir, adapters = tiny
    root = tmp_path / "root"
    shutil.copytree(adapters["sql"], root / "sql")
    expected = {}
    for name, (build, error) in BROKEN.items():
        build(adapters["poem"], root / name)
        expected[name] = getattr(errors, error)
    expected["outside"] = errors.AdapterPolicyError  # resolved by a plugin off the allowlist
    cfg = config(
        model_dir,
        local_roots=(str(root),),
        lora_name_template=f"file://{root}/{{name}}",
        allow_sources=("s3://allowed-bucket/*",),
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    async with AsyncEngine(cfg) as engine:
        engine.testing.adapters.fetcher.plugins.register(
            NamePlugin({"outside": "s3://other-bucket/outside"}), "names"
        )

        async def failing(name: str) -> BaseException:
            with pytest.raises(errors.LoRAError) as ei:
                await collect(engine, PROMPT, SHORT, adapter=name)
            return ei.value

        async def bad_static() -> BaseException:
            with pytest.raises(errors.AdapterDigestError) as ei:
                await engine.add_adapter("pinned-sql", f"file://{root}/sql", sha256="ab" * 32)
            return ei.value

        base, good, *errs = await asyncio.gather(
            collect(engine, PROMPT, LONG),
            collect(engine, PROMPT, LONG, adapter="sql"),
            bad_static(),
            *(failing(name) for name in expected),
        )
        for name, err in zip(expected, errs[1:], strict=True):
            assert type(err) is expected[name], (name, err)
        assert "sha256" in str(errs[0])
        assert "overlaps" in str(errs[1 + list(expected).index("overlapping")])
        assert "safetensors required" in str(errs[1 + list(expected).index("bin-only")])
        for out in (base, good):
            assert len(out[0]) == LONG.max_tokens and out[2][-1].finish_reason == "length"
        stats = engine.stats()
        assert stats["adapters"]["load_failures"] == len(expected)
        assert sorted(a["name"] for a in engine.list_adapters()) == ["sql"]
        # the engine keeps serving; a failed name is retried (and fails again) on request
        again = await failing("truncated")
        assert type(again) is errors.AdapterFormatError
        tokens, _, _ = await collect(engine, PROMPT, SHORT, adapter="sql")
        assert tokens == good[0][: SHORT.max_tokens]
        assert_idle(engine)
        await wait_until(lambda: not staged_leftovers(engine), "failed loads' staging dirs removed")
    hf = HFReference(model_dir, {"sql": adapters["sql"]})
    compare(good[0], *hf.greedy(PROMPT, "sql", LONG.max_tokens))
    compare(base[0], *hf.greedy(PROMPT, None, LONG.max_tokens))


async def test_rejected_request_does_not_register_its_dynamic_name(tiny, tmp_path):
    """An unknown name resolved for a request that is then rejected (bad prompt) must not stay
    in the registry: clients could grow it without bound with made-up names."""
    model_dir, adapters = tiny
    root = tmp_path / "root"
    shutil.copytree(adapters["sql"], root / "sql")
    cfg = config(model_dir, local_roots=(str(root),), lora_name_template=f"file://{root}/{{name}}")
    async with AsyncEngine(cfg) as engine:
        for i in range(3):
            with pytest.raises(InvalidRequestError):
                await collect(engine, [], SHORT, adapter=f"made-up-{i}")
            with pytest.raises(InvalidRequestError):
                await collect(engine, [1, 2], SamplingParams(max_tokens=10_000), adapter="sql")
        assert engine.list_adapters() == []
        assert engine.stats()["adapter_refs"] == {}
        tokens, _, _ = await collect(engine, PROMPT, SHORT, adapter="sql")
        assert len(tokens) == SHORT.max_tokens
        assert [a["name"] for a in engine.list_adapters()] == ["sql"]
        assert_idle(engine)


async def test_lost_staging_is_fetched_again_and_must_keep_its_digest(tiny, tmp_path):
    """A static adapter's staged copy vanishes (cache cleaned) before it is loaded: the engine
    fetches the source again and accepts it only with the registered digest (fail closed)."""
    model_dir, adapters = tiny
    root = tmp_path / "root"
    for name in ("sql", "poem"):
        shutil.copytree(adapters[name], root / name)
    async with AsyncEngine(config(model_dir, adapter_cache_dir=str(tmp_path / "cache"))) as engine:
        for name in ("sql", "poem"):
            await engine.add_adapter(name, f"file://{root / name}")
            v = engine.testing.adapters.registry.get(name)
            await engine.testing.adapters.copy_written(v)  # (written after the load's pass)
            evict_cpu(engine, name)  # (add_adapter's pass keeps its image: not loaded now)
            shutil.rmtree(v.local_dir)
        derived_adapter(adapters["poem"], root / "poem", seed=9)  # the source changed meanwhile

        async def changed():
            with pytest.raises(errors.AdapterDigestError, match="changed") as ei:
                await collect(engine, PROMPT, SHORT, adapter="poem")
            return ei.value

        base, sql, _ = await asyncio.gather(
            collect(engine, PROMPT, LONG), collect(engine, PROMPT, LONG, adapter="sql"), changed()
        )
        assert len(base[0]) == len(sql[0]) == LONG.max_tokens
        assert engine.testing.adapters.registry.get("sql").local_dir.is_dir()  # staged again
        await changed()  # still refused on retry
        assert_idle(engine)
    hf = HFReference(model_dir, {"sql": adapters["sql"]})
    compare(sql[0], *hf.greedy(PROMPT, "sql", LONG.max_tokens))


class _FailingWriter:
    """A slot writer whose writes fail where the CUDA writer's thread would: logged there,
    recorded on the job, nothing raised into the step."""

    def submit(self, job, after, *, paced: bool) -> None:
        job.error = RuntimeError("the device copy failed")
        job.issued.set()

    def close(self) -> None:
        pass


async def test_a_failed_slot_write_fails_its_waiting_requests(tiny):
    """A slot write that fails in the writer (not joined by its requests) fails the requests
    waiting on that adapter with a typed error and gives the slot back; before, its version held
    a slot that never landed and its requests waited forever. A later request writes again."""
    model_dir, adapters = tiny
    async with AsyncEngine(config(model_dir, slot_write_join_bytes=0)) as engine:
        await engine.add_adapter("poem", str(adapters["poem"]))
        slots = engine.testing.adapters.slots
        writer, slots.writer = slots.writer, _FailingWriter()
        with pytest.raises(errors.LoRAError, match="slot write") as err:
            await asyncio.wait_for(collect(engine, PROMPT, SHORT, adapter="poem"), 15)
        assert "the device copy failed" in str(err.value)
        v = engine.testing.adapters.registry.get("poem")
        assert slots.slot_of(v) is None and not slots.pending()
        slots.writer = writer
        tokens, _, _ = await collect(engine, PROMPT, SHORT, adapter="poem")
        assert len(tokens) == SHORT.max_tokens and slots.is_ready(v)
        assert_idle(engine)
