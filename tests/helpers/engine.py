"""The CPU engine of the engine tests: ``config`` (its EngineConfig), ``register`` (adapters by
name -> folder), ``collect`` (one request's tokens, text and outputs) and ``assert_idle`` (no
blocks, requests or adapter references left)."""

from __future__ import annotations

from loraplex.engine import EngineConfig


def config(model_dir, **kw) -> EngineConfig:
    base = dict(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        max_loras=2,
        max_cpu_loras=3,
        max_lora_rank=16,
        block_size=4,
        max_num_batched_tokens=48,
    )
    base.update(kw)
    return EngineConfig(**base)


async def collect(engine, prompt, params, adapter=None, request_id=None):
    tokens, text, outs = [], "", []
    async for out in engine.generate(prompt, params, adapter=adapter, request_id=request_id):
        tokens += out.token_ids
        text += out.text
        outs.append(out)
    return tokens, text, outs


async def register(engine, adapters):
    for name, path in adapters.items():
        await engine.add_adapter(name, f"file://{path}")


def evict_cpu(engine, *names):
    """Drop the named adapters' CPU-tier images (add_adapter keeps one): their next request
    loads (stages) them again."""
    registry = engine.testing.adapters.registry
    for name in names:
        assert registry.evict(registry.get(name)), name


def evict_all_cpu(engine):
    """Drop every idle CPU-tier image (add_adapter keeps one while the tier has room): a
    scripted run then starts with cold loads."""
    registry = engine.testing.adapters.registry
    for v in list(registry.versions()):
        registry.evict(v)


def assert_idle(engine):
    s = engine.stats()
    assert s["num_used_blocks"] == 0, s
    assert s["running"] == 0 and s["waiting"] == 0, s
    for key, refs in s["adapter_refs"].items():
        assert refs["users"] == 0 and refs["slot_refs"] == 0, (key, refs)
