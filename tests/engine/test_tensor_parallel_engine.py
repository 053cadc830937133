"""Tensor parallelism in the engine (engine/parallel/): ``AsyncEngine`` with
``tensor_parallel_size=2`` on CPU (gloo over 127.0.0.1, one worker process) against one
process: the same greedy tokens with mixed adapters, cold loads and evictions; a killed worker
fails the engine with a typed error instead of hanging; shutdown leaves no process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import structlog.testing

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import TensorParallelWorkerError
from loraplex.engine.model.tp import TensorParallelError
from tests.helpers.lifecycle import assert_idle, collect, config

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# (prompt, adapter) per request; each phase runs its requests at once. Two GPU slots and two
# CPU-tier places for three adapters: phase 2's "sql" is cold-loaded while "chat" decodes and
# evicts "poem" (slot and CPU tier); phase 3 loads "poem" again from its files.
PHASES = [
    [([5, 9, 13, 2, 7], None), ([5, 9, 13, 2, 7], "poem"), ([11, 3, 8, 40], "chat")],
    [([20, 21, 22], "sql"), ([7, 7, 1, 90, 4, 4], "chat")],
    [([5, 9, 13, 2, 7], "poem"), ([60, 3], "sql"), ([33], None)],
]


def _config(model_dir, size: int):
    return config(model_dir, max_loras=2, max_cpu_loras=2, tensor_parallel_size=size)


async def _serve(model_dir, adapters, size: int) -> tuple[list, AsyncEngine, dict]:
    """Every phase's tokens, the closed engine, and its stats before closing."""
    async with AsyncEngine(_config(model_dir, size)) as engine:
        for name in ("poem", "chat", "sql"):
            await engine.add_adapter(name, f"file://{adapters[name]}")
        tokens = []
        for phase in PHASES:
            outs = await asyncio.gather(
                *(collect(engine, prompt, GREEDY, adapter) for prompt, adapter in phase)
            )
            tokens.append([t for t, _, _ in outs])
        assert_idle(engine)
        stats = engine.stats()
        stats["max_rows"] = max(r.rows for r in engine.testing.step_log)
        stats["workers"] = getattr(engine.testing.executor.runner, "group", None)
    return tokens, engine, stats


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_tp2_engine_gives_the_tokens_of_one_process(tiny, monkeypatch):
    """Base rows and two adapters of different rank (8: every module; 16 rsLoRA: k / o / down)
    in one batch, a third (rank 4) cold-loaded while serving, evictions and a reload."""
    model_dir, adapters = tiny
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # the workers keep the environment's NCCL_*
    want, _, _ = await _serve(model_dir, adapters, 1)
    got, _, stats = await _serve(model_dir, adapters, 2)
    assert got == want
    assert stats["max_rows"] >= 3  # base + two adapters decoded in one step
    assert stats["adapters"]["gpu_evictions"] >= 2 and stats["adapters"]["cpu_evictions"] >= 1
    group = stats["workers"]
    assert group is not None and group.size == 2
    assert group.worker_env == [{**group.worker_env[0], "NCCL_NVLS_ENABLE": "0"}]
    assert all(p.poll() is not None and _gone(p.pid) for p in group.procs)  # none left over


async def test_killed_worker_fails_the_engine_loudly(tiny):
    model_dir, adapters = tiny
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine = AsyncEngine(_config(model_dir, 2))
    await engine.start()
    try:
        await engine.add_adapter("poem", f"file://{adapters['poem']}")
        group = engine.testing.executor.runner.group
        (worker,) = group.procs

        async def stream() -> int:
            n = 0
            async for out in engine.generate([5, 9, 13], long, adapter="poem"):
                if n == 0:  # mid-serve: the request runs, more steps are coming
                    os.kill(worker.pid, signal.SIGKILL)
                n += len(out.token_ids)
            return n

        with structlog.testing.capture_logs() as logs:  # (and no tracebacks rendered)
            with pytest.raises(TensorParallelWorkerError, match="rank 1"):
                await asyncio.wait_for(stream(), timeout=60)
            with pytest.raises(TensorParallelWorkerError):  # later requests fail the same way
                await asyncio.wait_for(collect(engine, [4, 4], GREEDY), timeout=60)
        failed = [e for e in logs if e["event"] == "tensor_parallel_failed"]
        assert len(failed) == 1 and f"pid {worker.pid}" in failed[0]["error"]
    finally:
        await asyncio.wait_for(engine.close(), timeout=60)
    assert all(p.poll() is not None and _gone(p.pid) for p in group.procs)


async def test_worker_dead_before_the_rendezvous_fails_the_start_at_once(tiny, monkeypatch):
    """A worker that dies after reporting "up" never joins the group: the start fails with a
    typed error naming it, well before the rendezvous' own 120 s timeout."""
    from loraplex.engine.parallel.group import COLLECTIVE_TIMEOUT_S, WorkerGroup

    model_dir, _ = tiny
    wait, killed = WorkerGroup.wait, []

    def wait_then_kill(self, rank, kind, *a, **kw):
        msg = wait(self, rank, kind, *a, **kw)
        if kind == "up":
            proc = self.procs[rank - 1]
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc)
        return msg

    monkeypatch.setattr(WorkerGroup, "wait", wait_then_kill)
    engine = AsyncEngine(_config(model_dir, 2))
    t0 = time.monotonic()
    with pytest.raises(TensorParallelWorkerError, match="rank 1"):
        await asyncio.wait_for(engine.start(), timeout=COLLECTIVE_TIMEOUT_S / 2)
    assert time.monotonic() - t0 < COLLECTIVE_TIMEOUT_S / 2
    await asyncio.wait_for(engine.close(), timeout=60)
    assert killed and all(p.poll() is not None and _gone(p.pid) for p in killed)


async def test_models_that_do_not_split_fail_before_workers_start(tiny):
    model_dir, _ = tiny  # 4 attention heads, 2 KV heads
    with pytest.raises(TensorParallelError, match="heads"):
        await AsyncEngine(_config(model_dir, 3)).start()
    with pytest.raises(TensorParallelError, match="fp8"):
        cfg = config(model_dir, tensor_parallel_size=2, quantization="fp8")
        await AsyncEngine(cfg).start()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _config(model_dir, 0)


def _exited(pid: int) -> bool:
    """Gone, or a zombie left for its (new) parent to reap."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[:2] == ["State:", "Z"] for line in f)
    except FileNotFoundError:
        return True


SCRIPT = """
import asyncio, sys, time
from loraplex.engine import AsyncEngine, EngineConfig
async def main():
    engine = AsyncEngine(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32",
                                      max_loras=0, tensor_parallel_size=2))
    await engine.start()
    print("WORKER", engine.testing.executor.runner.group.procs[0].pid, flush=True)
    time.sleep(600)
asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_exit_when_the_engine_process_dies(tiny):
    """The engine process killed outright (no close, no atexit): its worker sees its
    connection close and exits."""
    model_dir, _ = tiny
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(model_dir)], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip
    try:
        line = next(x for x in proc.stdout if x.startswith("WORKER "))  # (logs go to stdout)
        worker = int(line.split()[1])
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while not _exited(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _exited(worker)


def test_shards_see_the_full_config_and_refuse_dora():
    """On a rank, ``model.cfg`` is its shard's; adapter checks and slot images read
    ``full_config``. DoRA's row norms span the whole row: refused when the load computes them."""
    from types import SimpleNamespace

    from loraplex.engine.model.lora.dora import row_scales
    from loraplex.engine.model.tp import TensorParallel, TPShard, full_config, shard_config
    from tests.helpers.tp import CFG

    tp = TensorParallel(CFG, TPShard(1, 2))
    shard = SimpleNamespace(cfg=shard_config(CFG, tp.shard), tp=tp)
    assert shard.cfg.vocab_size == 125 and full_config(shard) is CFG
    assert full_config(SimpleNamespace(cfg=CFG, tp=None)) is CFG
    with pytest.raises(TensorParallelError, match="DoRA"):
        row_scales(shard, "d", {}, {})
