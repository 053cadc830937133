"""What the engine reports: the fields of each request's canonical log line, and the engine's
counters (``engine_stats``, what ``EngineCore.stats`` returns)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from loraplex.engine.adapters.version import AdapterState
from loraplex.engine.warmup import COMPILES

if TYPE_CHECKING:
    from loraplex.engine.request import Request

__all__ = ["engine_stats", "request_summary"]


def request_summary(req: Request) -> dict[str, Any]:
    """Fields of the canonical per-request log line (seconds, rounded to µs)."""
    now = time.monotonic()
    times = req.token_times
    return {
        "request_id": req.request_id,
        "adapter": req.adapter.name if req.adapter else None,
        "adapter_digest": req.adapter.digest[:12] if req.adapter else None,
        "prompt_tokens": len(req.prompt_ids),
        "output_tokens": len(req.output_ids),
        "cached_tokens": req.num_cached,
        "finish_reason": req.finish_reason,
        "preemptions": req.num_preemptions,
        "queue_s": round(req.scheduled_time - req.arrival, 6) if req.scheduled_time else None,
        "ttft_s": round(times[0] - req.arrival, 6) if times else None,
        "e2e_s": round(now - req.arrival, 6),
    }


def engine_stats(core: Any) -> dict[str, Any]:
    """Counters of an ``EngineCore`` for tests, metrics and studies (read on the event loop):
    KV blocks, queues, adapter residency and references, compiles, loop lag, requests."""
    b = core.blocks
    sched = core.scheduler
    registry, slots = core.adapters.registry, core.adapters.slots
    pool = core.adapters.pool
    return {
        "max_loras": core.config.max_loras,
        "running_adapters": sorted({r.adapter.name for r in sched.running if r.adapter}),
        "waiting_adapters": sorted({r.adapter.name for r in sched.waiting if r.adapter}),
        "gpu_resident": [v.name for v in slots.resident],
        "cpu_resident": [v.name for v in registry.versions() if v.state is AdapterState.CPU],
        "num_blocks": b.num_blocks,
        "num_free_blocks": b.num_free_blocks,
        "num_used_blocks": b.num_used_blocks,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "preemptions": sched.num_preemptions,
        "prefix_cache_queries": b.stats.queries,
        "prefix_cache_hits": b.stats.hits,
        "adapter_refs": {
            f"{v.name}@{v.digest[:12]}#{v.version}": {  # unique: digests may be pending
                "users": v.users,
                "slot_refs": slots.refs(v),
                "slot": slots.slot_of(v),
            }
            for v in registry.versions()
        },
        "adapters": dict(registry.stats),
        "kernel_compiles_while_serving": len(COMPILES.while_serving),
        "host_pool_regions_in_use": pool.in_use() if pool is not None else 0,
        **(core.loop_lag.summary() if core.loop_lag is not None else {}),
        # speculative decoding (spec/control.py): proposed / accepted tokens, per adapter
        **({"speculative": core.spec.stats()} if core.spec is not None else {}),
        **core.counters,
    }
