"""Full-table adapters (``modules_to_save`` on ``embed_tokens`` / ``lm_head``, model/lora/full.py)
through AsyncEngine: cold loads, CPU tier, the one full-table slot taken in turns (eviction
and re-writes) next to plain adapters, prefix-cache identity, against HF PEFT; typed 400
refusals through the HTTP admin route that leave nothing loaded."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import AdapterConfigError
from loraplex.engine.server import create_app, start_server
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.models import copy_adapter, make_peft_adapter
from tests.helpers.peft_oracle import HFReference, compare, http_greedy_ids

pytest.importorskip("peft")

TOKEN = "full-token"


@pytest.fixture(scope="module")
def full(tiny, tmp_path_factory):
    model_dir, _ = tiny
    root = tmp_path_factory.mktemp("full-forms")
    return root, {
        "swap": make_peft_adapter(
            model_dir, root / "swap", seed=51, r=4, alpha=8,
            target_modules=["q_proj", "down_proj"], modules_to_save=["embed_tokens", "lm_head"],
        ),
        "newhead": make_peft_adapter(
            model_dir, root / "newhead", seed=52, r=8, alpha=16, target_modules=["v_proj"],
            modules_to_save=["lm_head"],
        ),
    }  # fmt: skip


async def test_full_tables_through_the_engine_match_peft(tiny, full):
    model_dir, adapters = tiny
    _, forms = full
    use = {"sql": adapters["sql"], "poem": adapters["poem"], **forms}
    g = random.Random(13)
    choices = [None, "swap", "sql", "newhead", "poem", "swap"]
    shared = [g.randrange(3, 250) for _ in range(9)]  # one prompt on every adapter
    reqs = [
        (f"r{i}", [g.randrange(3, 250) for _ in range(g.randint(2, 18))], choices[i % 6], 5)
        for i in range(12)
    ]
    reqs += [(f"s{i}", shared, a, 5) for i, a in enumerate(choices[:5])]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    # two slots, one of them with full tables: the two full adapters take turns in slot 0,
    # the plain ones use slot 1 (and 0 while it is free); three CPU-tier adapters for four
    cfg = config(model_dir, max_loras=2, max_cpu_loras=3, max_full_module_loras=1)
    async with AsyncEngine(cfg) as engine:
        report = engine.capacity_report()
        assert report["full_module_slots"] == 1
        assert report["full_module_bytes"] == 2 * 256 * 64 * 4  # embed + head, (V, H) float32
        assert engine.testing.executor.model.full_modules.embed.shape == (1, 256, 64)
        await register(engine, use)
        results = await asyncio.gather(
            *(collect(engine, p, params, a, rid) for rid, p, a, _ in reqs)
        )
        again = [await collect(engine, p, params, a) for _, p, a, _ in reqs[-5:]]
        s = engine.stats()
        assert_idle(engine)
    assert s["adapters"]["gpu_evictions"] > 0
    # CPU-tier evictions and loads again from the staged files (cold loads of full tables)
    assert s["adapters"]["cpu_evictions"] > 0 and s["adapters"]["loads"] > len(use)
    hf = HFReference(model_dir, use)
    outs = {}
    for (_, prompt, a, n), (tokens, _, _) in zip(reqs + reqs[-5:], results + again, strict=True):
        ref, gaps = hf.greedy(prompt, a, n)
        compare(tokens, ref, gaps)
        if prompt is shared:
            outs[a] = ref
    # the shared prompt's KV blocks are not reused across adapters: each output is its own
    assert outs["swap"] != outs[None] and outs["newhead"] != outs[None]


async def test_full_tables_refused_without_full_slots(tiny, full):
    model_dir, _ = tiny
    _, forms = full
    async with AsyncEngine(config(model_dir)) as engine:  # max_full_module_loras = 0
        assert engine.testing.executor.model.full_modules is None  # the step path as before
        assert engine.capacity_report()["full_module_bytes"] == 0
        with pytest.raises(AdapterConfigError, match="modules_to_save") as e:
            await engine.add_adapter("swap", f"file://{forms['swap']}")
        assert e.value.field == "modules_to_save"
        assert "swap" not in [a["name"] for a in engine.list_adapters()]


def test_full_module_slots_config_bounds(tiny):
    model_dir, _ = tiny
    with pytest.raises(ValueError, match="between 0 and max_loras"):
        config(model_dir, max_loras=2, max_full_module_loras=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        config(model_dir, max_full_module_loras=1, tensor_parallel_size=2)


async def _post(url: str, body: dict) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_bad_full_tables_are_typed_400s_over_http(tiny, full):
    model_dir, _ = tiny
    root, forms = full
    src = forms["newhead"]
    tensors = load_file(src / "adapter_model.safetensors")
    key = "base_model.model.lm_head.weight"
    grown = torch.cat([tensors[key], tensors[key][:5]])  # an adapter that added 5 tokens
    resized = copy_adapter(src, root / "resized", tensors={**tensors, key: grown})
    cases = [
        ("resized", resized, 1, "AdapterShapeError", "vocabulary rows"),
        ("noslots", src, 0, "AdapterConfigError", "modules_to_save"),
    ]
    for name, path, slots, kind, words in cases:
        cfg = config(model_dir, kv_cache_bytes=8 << 20, local_roots=(str(root),),
                     max_full_module_loras=slots)  # fmt: skip
        async with AsyncEngine(cfg) as engine:
            runner, port = await start_server(create_app(engine, admin_token=TOKEN))
            try:
                url = f"http://127.0.0.1:{port}"
                body = {"lora_name": name, "lora_path": str(path)}
                status, err = await _post(url + "/v1/load_lora_adapter", body)
                assert status == 400 and err["error"]["type"] == kind, err
                assert words in err["error"]["message"], err
                async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
                    ids = [m["id"] for m in (await r.json())["data"]]
            finally:
                await runner.cleanup()
            assert name not in ids
            assert name not in [a["name"] for a in engine.list_adapters()]
            assert engine.stats()["adapters"]["loads"] == 0


async def test_full_tables_through_a_loader_process(tiny, full, tmp_path):
    """A helper process packs the LoRA weights into the host pool; the engine reads the full
    tables next to them (not in the region): same tokens as PEFT."""
    model_dir, adapters = tiny
    _, forms = full
    use = {"swap": forms["swap"], "sql": adapters["sql"], "newhead": forms["newhead"]}
    cfg = config(
        model_dir, max_loras=2, max_cpu_loras=3, max_full_module_loras=1, loader_processes=1,
        adapter_cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    prompt = [12, 7, 200, 45, 3, 88, 19, 5]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        await register(engine, use)
        got = {a: (await collect(engine, prompt, params, a))[0] for a in [*use, None]}
        v = engine.testing.adapters.registry.get("swap")
        assert v.full and v.region is not None
        assert set(v.adapter.full) == {"embed_tokens", "lm_head"}
        assert_idle(engine)
    hf = HFReference(model_dir, use)
    for a, tokens in got.items():
        ref, gaps = hf.greedy(prompt, a, 6)
        compare(tokens, ref, gaps)


@pytest.mark.gpu
async def test_full_tables_on_gpu_graphs_and_no_compiles_while_serving(tiny, full, tmp_path):
    """On CUDA: full-table adapters next to plain ones, decode and mixed steps as CUDA graphs
    (the embedding gather and the head kernel captured in them), loads through a helper and
    in-process; same tokens as PEFT and no kernel compiles after start-up."""
    model_dir, adapters = tiny
    _, forms = full
    use = {"sql": adapters["sql"], **forms}
    g = random.Random(8)
    work = [
        ([g.randrange(3, 250) for _ in range(g.randint(1, 60))], g.choice([None, *use]))
        for _ in range(16)
    ]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    hf = HFReference(model_dir, use)
    refs = [hf.greedy(p, a, 6) for p, a in work]
    for procs in (0, 1):
        cfg = config(
            model_dir, device="cuda", max_loras=2, max_cpu_loras=3, max_full_module_loras=1,
            loader_processes=procs, max_num_batched_tokens=128,
            adapter_cache_dir=str(tmp_path / f"cache{procs}"),
        )  # fmt: skip
        async with AsyncEngine(cfg) as engine:
            assert engine.testing.executor.runner.graphs is not None
            await register(engine, use)
            before = engine.stats()["kernel_compiles_while_serving"]
            outs = await asyncio.gather(*(collect(engine, p, params, a) for p, a in work))
            for (tokens, _, _), ref in zip(outs, refs, strict=True):
                compare(tokens, *ref)
            assert engine.stats()["kernel_compiles_while_serving"] == before
            assert_idle(engine)


async def test_full_tables_over_http(tiny, full):
    model_dir, _ = tiny
    _, forms = full
    prompt = [5, 17, 99, 3, 42, 8]
    cfg = config(model_dir, kv_cache_bytes=8 << 20, max_full_module_loras=1)
    async with AsyncEngine(cfg) as engine:
        await engine.add_adapter("swap", f"file://{forms['swap']}")
        ids = await http_greedy_ids(engine, "swap", prompt, 6)
    ref, gaps = HFReference(model_dir, {"swap": forms["swap"]}).greedy(prompt, "swap", 6)
    compare(ids, ref, gaps)
