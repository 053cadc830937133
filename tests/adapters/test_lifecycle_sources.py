"""Adapter lifecycle, sources: S3 (moto over HTTP), the Hugging Face Hub (a fake hub on
127.0.0.1) and local roots (traversal and symlink attempts), all through a running engine."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil

import boto3
import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import AdapterNotFoundError, AdapterPolicyError
from tests.helpers.fake_hub import FakeHub, adapter_files
from tests.helpers.lifecycle import assert_idle, collect, config
from tests.helpers.peft_oracle import HFReference, compare

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 150, 77]
_buckets = itertools.count()


@pytest.fixture
def s3_bucket(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:  # noqa: F811
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    name = f"lifecycle-{next(_buckets)}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


async def test_s3_dynamic_name_through_template_matches_hf_and_reports_stages(tiny, s3_bucket):
    model_dir, adapters = tiny
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for f in adapters["chat"].iterdir():
        s3.upload_file(str(f), s3_bucket, f"adapters/chat/{f.name}")
    cfg = config(
        model_dir,
        lora_name_template=f"s3://{s3_bucket}/adapters/{{name}}",
        allow_sources=(f"s3://{s3_bucket}/*",),
    )
    events: list[tuple[str, dict]] = []
    async with AsyncEngine(cfg) as engine:
        engine.subscribe(lambda e, d: events.append((e, d)))
        (tokens, _, outs), (base, _, _) = await asyncio.gather(
            collect(engine, PROMPT, GREEDY, adapter="chat"), collect(engine, PROMPT, GREEDY)
        )
        v = engine.testing.adapters.registry.get("chat")
        assert v.dynamic and v.pinned_uri == f"s3://{s3_bucket}/adapters/chat"
        with pytest.raises(AdapterNotFoundError):  # the template points at nothing
            await collect(engine, PROMPT, GREEDY, adapter="absent")
        assert_idle(engine)
    assert outs[-1].finish_reason == "length"
    hf = HFReference(model_dir, {"chat": adapters["chat"]})
    compare(tokens, *hf.greedy(PROMPT, "chat", GREEDY.max_tokens))
    compare(base, *hf.greedy(PROMPT, None, GREEDY.max_tokens))
    assert tokens != base

    loads = [d for e, d in events if e == "adapter_load"]
    ok = [d for d in loads if d["name"] == "chat"]
    assert len(ok) == 1 and ok[0]["ok"]
    timings = ok[0]["timings"]
    for stage in ("resolve", "fetch", "verify", "preflight", "stage"):
        assert stage in timings and timings[stage] >= 0.0, (stage, timings)
    failed = [d for d in loads if d["name"] == "absent"]
    assert len(failed) == 1 and not failed[0]["ok"]
    writes = [d for e, d in events if e == "slot_write"]
    assert [w["name"] for w in writes] == ["chat"]
    assert writes[0]["h2d_s"] >= 0.0 and writes[0]["nbytes"] > 0


async def test_hf_static_adapter_pins_commit_and_matches_hf(tiny, hub: FakeHub):  # noqa: F811
    model_dir, adapters = tiny
    sha = hub.commit("org/repo", {**adapter_files(adapters["math"]), "README.md": b"hi"})
    async with AsyncEngine(config(model_dir)) as engine:
        info = await engine.add_adapter("x", "hf://org/repo")
        v = engine.testing.adapters.registry.get("x")
        assert v.pinned_uri == f"hf://org/repo@{sha}"
        assert info["digest"] == v.digest
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="x")
        assert_idle(engine)
    assert hub.resolved_paths() and all(f"/resolve/{sha}/" in p for p in hub.resolved_paths())
    hf = HFReference(model_dir, {"math": adapters["math"]})
    compare(tokens, *hf.greedy(PROMPT, "math", GREEDY.max_tokens))


async def test_local_template_refuses_traversal_and_symlinks_out_of_root(tiny, tmp_path):
    model_dir, adapters = tiny
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(adapters["sql"], root / "sql")
    shutil.copytree(adapters["poem"], outside / "poem")
    (root / "escape").symlink_to(outside / "poem", target_is_directory=True)
    (root / "filelink").mkdir()  # a real folder whose weights are a link out of the root
    shutil.copy(adapters["poem"] / "adapter_config.json", root / "filelink")
    (root / "filelink" / "adapter_model.safetensors").symlink_to(
        outside / "poem" / "adapter_model.safetensors"
    )
    cfg = config(
        model_dir,
        local_roots=(str(root),),
        lora_name_template=f"file://{root}/{{name}}",
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        for name in ("../outside/poem", "../x", "sql/../../outside/poem", "/etc", "a/b/c", ".."):
            with pytest.raises(AdapterNotFoundError):
                await collect(engine, PROMPT, GREEDY, adapter=name)

        async def refused(name: str) -> BaseException:
            with pytest.raises(AdapterPolicyError) as ei:
                await collect(engine, PROMPT, GREEDY, adapter=name)
            return ei.value

        base, good, e1, e2 = await asyncio.gather(
            collect(engine, PROMPT, long),
            collect(engine, PROMPT, long, adapter="sql"),
            refused("escape"),
            refused("filelink"),
        )
        assert "outside the allowed roots" in str(e1) and "outside" in str(e2)
        assert len(base[0]) == len(good[0]) == 24 and base[0] != good[0]
        assert engine.stats()["adapters"]["load_failures"] == 2
        assert sorted(a["name"] for a in engine.list_adapters()) == ["sql"]
        assert_idle(engine)
        assert not list((tmp_path / "cache").rglob("*.part"))
    hf = HFReference(model_dir, {"sql": adapters["sql"]})
    compare(good[0], *hf.greedy(PROMPT, "sql", 24))
