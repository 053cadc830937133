"""What the engine reports about each request: the fields of its canonical log line.

Engine-wide counters are ``EngineCore.stats``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.engine.request import Request

__all__ = ["request_summary"]


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
