"""What the engine reports about itself: per-request summaries and engine-wide counters."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from loraplex.engine.lora.manager import AdapterState
from loraplex.engine.warmup import COMPILES

if TYPE_CHECKING:
    from loraplex.engine.core import EngineCore
    from loraplex.engine.request import Request

__all__ = ["request_summary", "engine_stats"]


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


def engine_stats(core: EngineCore) -> dict[str, Any]:
    """Counters for tests, metrics and studies (read on the event loop)."""
    b = core.blocks
    sched = core.scheduler
    return {
        "max_loras": core.config.max_loras,
        "running_adapters": sorted({r.adapter.name for r in sched.running if r.adapter}),
        "waiting_adapters": sorted({r.adapter.name for r in sched.waiting if r.adapter}),
        "gpu_resident": [v.name for v in core.adapters.resident],
        "cpu_resident": [v.name for v in core.adapters.versions() if v.state is AdapterState.CPU],
        "num_blocks": b.num_blocks,
        "num_free_blocks": b.num_free_blocks,
        "num_used_blocks": b.num_used_blocks,
        "running": len(core.scheduler.running),
        "waiting": len(core.scheduler.waiting),
        "preemptions": core.scheduler.num_preemptions,
        "prefix_cache_queries": b.stats.queries,
        "prefix_cache_hits": b.stats.hits,
        "adapter_refs": {
            f"{v.name}@{v.digest[:12]}#{v.version}": {  # unique: digests may be pending
                "users": v.users,
                "slot_refs": v.slot_refs,
                "slot": v.slot,
            }
            for v in core.adapters.versions()
        },
        "adapters": dict(core.adapters.stats),
        "kernel_compiles_while_serving": len(COMPILES.while_serving),
        "host_pool_regions_in_use": core.loader.pool.in_use() if core.loader.pool else 0,
        **core.loop_lag_summary(),
        **core.counters,
    }
