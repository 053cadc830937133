"""Cold loads through loader processes (``loader_processes`` > 0) and the host pool: same
tokens as in-process loads; a helper killed mid-load is replaced and the load retried once; a
second death fails only that adapter's requests; corrupt files and cancellation leak nothing
(refcounts, KV blocks, host-pool regions, staged files). The host pool and the staging
directory: test_loader_staging.py."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.adapters import loader_procs as loader_process
from loraplex.engine.adapters.registry import AdapterState
from loraplex.engine.errors import (
    AdapterDigestError,
    AdapterFormatError,
    AdapterValueError,
    LoaderProcessError,
)
from tests.helpers import slow_loader
from tests.helpers.lifecycle import (
    GREEDY,
    PROMPT,
    assert_idle,
    collect,
    evict_cpu,
    pool_idle,
    proc_config,
    truncated,
    wait_until,
)
from tests.helpers.peft_oracle import HFReference, compare

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


async def test_helper_loads_match_in_process_loads(tiny, lib, tmp_path):
    model_dir, _ = tiny
    results = {}
    for procs in (0, 1):
        cfg = proc_config(model_dir, tmp_path, loader_processes=procs, adapter_cache_dir=None)
        async with AsyncEngine(cfg) as engine:
            for name in ("sql", "poem", "chat"):
                info = await engine.add_adapter(name, str(lib[name]))
                assert len(info["digest"]) == 64
            outs = await asyncio.gather(
                *(collect(engine, PROMPT, GREEDY, adapter=n) for n in ("sql", "poem", "chat"))
            )
            results[procs] = [o[0] for o in outs]
            if procs:
                internals = engine.testing
                assert len(internals.adapters.fetcher.procs.pids) == 1
                assert all(v.region is not None for v in internals.adapters.registry.versions())
                pool_idle(engine)
            assert_idle(engine)
    assert results[0] == results[1]


async def test_killed_helper_is_replaced_and_the_load_retried(tiny, lib, tmp_path, monkeypatch):
    model_dir, _ = tiny
    monkeypatch.setattr(loader_process, "helper_command", slow_loader.command(delay=1.0))
    cfg = proc_config(model_dir, tmp_path)
    async with AsyncEngine(cfg) as engine:
        await engine.add_adapter("poem", str(lib["poem"]))
        evict_cpu(engine, "poem")  # its first request stages it (add_adapter's image dropped)
        procs = engine.testing.adapters.fetcher.procs
        base = asyncio.create_task(collect(engine, PROMPT, LONG))
        task = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="poem"))
        await wait_until(lambda: any(p.jobs for p in procs.procs), "a stage job in flight")
        first = procs.pids[0]
        os.kill(first, signal.SIGKILL)
        tokens, _, outs = await asyncio.wait_for(task, 60)
        assert len(tokens) == GREEDY.max_tokens and outs[-1].finish_reason == "length"
        assert procs.deaths == 1 and procs.pids and procs.pids[0] != first
        base_tokens, _, _ = await asyncio.wait_for(base, 60)
        assert len(base_tokens) == LONG.max_tokens  # the base stream never noticed
        assert_idle(engine)
        pool_idle(engine)


async def test_helper_dead_before_any_job_is_replaced(tiny, lib, tmp_path):
    model_dir, _ = tiny
    async with AsyncEngine(proc_config(model_dir, tmp_path)) as engine:
        procs = engine.testing.adapters.fetcher.procs
        first = procs.procs[0]
        os.kill(first.process.pid, signal.SIGKILL)
        await wait_until(lambda: first.dead, "the death seen by its reader")
        await engine.add_adapter("poem", str(lib["poem"]))  # a fresh helper takes the job
        tokens, _, _ = await collect(engine, PROMPT, GREEDY, adapter="poem")
        assert len(tokens) == GREEDY.max_tokens
        assert procs.pids and first.process.pid not in procs.pids
        assert_idle(engine)


async def test_second_death_fails_only_that_adapter(tiny, lib, tmp_path, monkeypatch):
    model_dir, _ = tiny
    monkeypatch.setattr(loader_process, "helper_command", slow_loader.command(delay=1.0))
    cfg = proc_config(model_dir, tmp_path)
    async with AsyncEngine(cfg) as engine:
        await engine.add_adapter("poem", str(lib["poem"]))
        evict_cpu(engine, "poem")  # its first request stages it (add_adapter's image dropped)
        procs = engine.testing.adapters.fetcher.procs
        base = asyncio.create_task(collect(engine, PROMPT, LONG))
        task = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="poem"))
        for death in (1, 2):
            await wait_until(lambda: any(p.jobs for p in procs.procs), "a job in flight")
            os.kill(procs.pids[0], signal.SIGKILL)
            await wait_until(lambda d=death: procs.deaths == d, "the death seen")
        with pytest.raises(LoaderProcessError, match="died twice"):
            await asyncio.wait_for(task, 60)
        base_tokens, _, _ = await asyncio.wait_for(base, 60)
        assert len(base_tokens) == LONG.max_tokens
        assert engine.testing.adapters.registry.get("poem").state is not AdapterState.LOADING
        assert_idle(engine)
        pool_idle(engine)
        # a fresh helper serves the next request for the same adapter
        tokens, _, _ = await asyncio.wait_for(collect(engine, PROMPT, GREEDY, adapter="poem"), 60)
        assert len(tokens) == GREEDY.max_tokens


async def test_corrupt_adapter_typed_error_through_the_helper(tiny, lib, tmp_path):
    model_dir, _ = tiny
    bad = truncated(lib["poem"], tmp_path / "lib" / "bad")
    async with AsyncEngine(proc_config(model_dir, tmp_path)) as engine:
        with pytest.raises(AdapterFormatError):  # the preflight, in the helper
            await engine.add_adapter("bad", str(bad))
        with pytest.raises(AdapterDigestError):
            await engine.add_adapter("poem", str(lib["poem"]), sha256="0" * 64)
        tokens, _, _ = await collect(engine, PROMPT, GREEDY)
        assert len(tokens) == GREEDY.max_tokens
        assert engine.list_adapters() == []
        assert_idle(engine)
        pool_idle(engine)
        leftovers = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
        assert leftovers == []


@pytest.mark.parametrize("procs", [0, 1], ids=["threads", "helper"])
async def test_registration_refuses_garbage_weights(tiny, lib, tmp_path, procs):
    """NaN / Inf / huge weights are refused when the adapter is added (an admin load's 400),
    not only when a request first stages it."""
    model_dir, _ = tiny
    bad = Path(shutil.copytree(lib["poem"], tmp_path / "lib" / "nan"))
    tensors = load_file(bad / "adapter_model.safetensors")
    key = sorted(k for k in tensors if ".lora_A." in k)[0]
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    async with AsyncEngine(proc_config(model_dir, tmp_path, loader_processes=procs)) as engine:
        for trusted in (True, False):
            with pytest.raises(AdapterValueError) as ei:
                await engine.add_adapter("nan", str(bad), trusted=trusted)
            assert ei.value.field == key
        assert engine.list_adapters() == []
        assert_idle(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_gpu_pool_loads_mixed_graphs_and_no_compiles_while_serving(tiny, lib, tmp_path):
    """On CUDA: loads through a helper into the registered host pool, and steps that mix
    prefills of many lengths with decodes (mixed-step CUDA graphs, or eager) match HF PEFT;
    after start-up no kernel compiles (the warm-up covers every variant the workload hits)."""
    model_dir, _ = tiny
    g = random.Random(5)
    work = [
        ([g.randrange(3, 250) for _ in range(g.randint(1, 80))], g.choice([None, *lib]))
        for _ in range(24)
    ]
    hf = HFReference(model_dir, lib)
    refs = [hf.greedy(p, a, GREEDY.max_tokens) for p, a in work]
    for procs, mixed in ((0, 256), (1, 256), (1, 0)):
        cfg = proc_config(
            model_dir, tmp_path, device="cuda", loader_processes=procs, adapter_cache_dir=None,
            max_num_batched_tokens=128, mixed_graph_tokens=mixed,
        )  # fmt: skip
        async with AsyncEngine(cfg) as engine:
            assert (engine.testing.executor.mixed_graphs is not None) == bool(mixed)
            for name in lib:
                await engine.add_adapter(name, str(lib[name]))
            before = engine.stats()["kernel_compiles_while_serving"]
            outs = await asyncio.gather(*(collect(engine, p, GREEDY, adapter=a) for p, a in work))
            for (tokens, _, _), ref in zip(outs, refs, strict=True):
                compare(tokens, *ref)
            assert engine.stats()["kernel_compiles_while_serving"] == before
            pool_idle(engine)
            assert_idle(engine)


async def test_cancelled_stage_keeps_its_region_until_the_helper_stopped_writing(
    tiny, lib, tmp_path, monkeypatch
):
    """The helper's stage thread writes into the engine's host-pool region: a cancelled load
    gets its region back only once that thread has returned (before, the helper replied
    "cancelled" at once and the region could go to the next load while still being written)."""
    model_dir, _ = tiny
    hold = 1.0
    monkeypatch.setattr(loader_process, "helper_command", slow_loader.command(stage_hold=hold))
    cfg = proc_config(model_dir, tmp_path)
    async with AsyncEngine(cfg) as engine:
        await engine.add_adapter("poem", str(lib["poem"]))
        evict_cpu(engine, "poem")  # its first request stages it (add_adapter's image dropped)
        procs = engine.testing.adapters.fetcher.procs
        pool = engine.testing.adapters.pool
        task = asyncio.create_task(collect(engine, PROMPT, GREEDY, adapter="poem"))
        await wait_until(lambda: any(p.jobs for p in procs.procs), "a stage job in flight")
        t0 = time.monotonic()
        await asyncio.sleep(0.1)  # the helper's thread is inside its write now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: pool.in_use() == 0, "region released")
        assert time.monotonic() - t0 >= hold * 0.8  # not before the thread returned
        v = engine.testing.adapters.registry.get("poem")
        assert v.state is AdapterState.REGISTERED and v.region is None
        assert_idle(engine)


async def test_shared_fields_reach_each_helper_once_per_change():
    """``call(..., shared=)``: the source policy and the environment cross a helper's pipe only
    when they differ from what that helper last got; ``resolve_shared`` (the helper's side)
    gives every job its whole payload back."""
    import pickle

    from loraplex.engine.adapters.loader_procs import LoaderProcesses, _Proc, resolve_shared
    from loraplex.resolvers import SourcePolicy

    class Conn:
        def __init__(self) -> None:
            self.msgs: list[tuple] = []

        def send(self, msg: tuple) -> None:
            self.msgs.append(pickle.loads(pickle.dumps(msg)))

    class Popen:
        pid = 0

        def poll(self) -> None:
            return None

    procs = LoaderProcesses(0, None, None)  # type: ignore[arg-type]
    conns = [Conn(), Conn()]
    procs.procs += [_Proc(Popen(), c) for c in conns]  # type: ignore[arg-type]
    p1 = SourcePolicy(local_dirs=frozenset({"/srv/a"}))
    p2 = p1.union(SourcePolicy(local_dirs=frozenset({"/srv/b"})))
    calls = [(p1, "x"), (p1, "x"), (p1, "x"), (p1, "x"), (p2, "x"), (p2, "y")]
    tasks = []
    for i, (policy, home) in enumerate(calls):
        shared = {"policy": policy, "env": {"HF_HOME": home}}  # a new dict each time
        tasks.append(asyncio.ensure_future(procs.call("prepare", {"i": i}, shared=shared)))
        await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    got: dict[int, dict] = {}
    sent = []  # per job: which shared fields crossed the pipe
    for conn in conns:
        cache: dict = {}
        jobs = [m[2] for m in conn.msgs if m[0] == "prepare"]
        assert jobs and all(v is not None for v in jobs[0]["_shared"].values())
        for payload in jobs:
            sent.append({k for k, v in payload["_shared"].items() if v is not None})
            full = resolve_shared(cache, payload)
            got[full["i"]] = full
    assert sorted(got) == list(range(len(calls)))
    for i, (policy, home) in enumerate(calls):
        assert got[i]["policy"] == policy and got[i]["env"] == {"HF_HOME": home}
    # each value once per helper that needed it, not once per job: p1 and p2 to both helpers,
    # HF_HOME=x to both, =y to the one that ran the last job
    assert sum("policy" in f for f in sent) == 4
    assert sum("env" in f for f in sent) == 3


async def test_a_job_missing_a_shared_field_fails_instead_of_hanging(tiny, lib, tmp_path):
    """A helper asked to reuse a shared field it never got answers with a typed error (the
    registration fails, the engine and the helper keep serving)."""
    model_dir, _ = tiny
    async with AsyncEngine(proc_config(model_dir, tmp_path)) as engine:
        procs = engine.testing.adapters.fetcher.procs
        await wait_until(lambda: procs.pids, 30)
        (proc,) = procs.procs
        env = {k: x for k, x in os.environ.items() if k.startswith(("HF_", "AWS_", "HUGGING"))}
        proc.sent["env"] = env  # as if sent before: the engine sends "unchanged"
        with pytest.raises(LoaderProcessError, match="env"):
            await engine.add_adapter("sql", str(lib["sql"]))
        proc.sent.clear()
        info = await engine.add_adapter("sql", str(lib["sql"]))
        assert len(info["digest"]) == 64 and procs.pids == [proc.process.pid]
        assert_idle(engine)
