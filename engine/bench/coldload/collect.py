"""What a run records from the engine: load and slot-write events with wall-clock placement,
and the engine's Request objects (arrival, admission, token times, tier).

Events carry durations only; the collector stamps ``time.monotonic()`` when each arrives (the
engine emits ``adapter_load`` right after the stage step and ``slot_write`` when the write is
seen complete), and lays the stages out backwards from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STAGES", "FETCH_STAGES", "LoadRecord", "WriteRecord", "Collector"]

FETCH_STAGES = ("resolve", "fetch", "verify", "preflight")
# host_wait: the wait for a host-pool region before the pass (or the re-stage) can write
STAGES = ("host_wait", *FETCH_STAGES, "stage")


@dataclass
class LoadRecord:
    """One completed (or failed) adapter load: resolve .. stage."""

    name: str
    digest: str
    ok: bool
    t_end: float  # monotonic seconds when the event arrived
    total_s: float
    nbytes: int  # tensor bytes of the staged adapter
    fresh: bool  # the fetch stages ran (False: re-staged from files fetched earlier)
    stages: dict[str, float]
    error: str | None = None

    @property
    def t_start(self) -> float:
        return self.t_end - self.total_s

    def intervals(self) -> list[tuple[str, float, float]]:
        """(stage, start, end), consecutive, ending at ``t_end``, inside ``[t_start, t_end]``."""
        out = []
        t = self.t_end
        for s in reversed(STAGES):
            d = self.stages.get(s, 0.0)
            if d > 0:
                out.append((s, max(t - d, self.t_start), t))
                t -= d
        return out[::-1]


@dataclass
class WriteRecord:
    """One host->device slot write (issue to observed completion)."""

    name: str
    slot: int
    t_end: float
    h2d_s: float  # issue to observed completion (the timeline)
    nbytes: int
    gpu_s: float | None = None  # the copy itself, by CUDA events around it
    copy_bytes: int | None = None  # bytes it moved host -> device (the packed image)

    @property
    def t_start(self) -> float:
        return self.t_end - self.h2d_s

    @property
    def gbps(self) -> float | None:
        """Copy bandwidth: packed bytes over the copy's GPU time where the engine reports it
        (observed completion lags the copy by up to a step)."""
        if self.gpu_s:
            return (self.copy_bytes or self.nbytes) / self.gpu_s / 1e9
        return self.nbytes / self.h2d_s / 1e9 if self.h2d_s > 0 else None


@dataclass
class Collector:
    """Subscribes to an engine's events and keeps every Request submitted to it."""

    loads: list[LoadRecord] = field(default_factory=list)
    writes: list[WriteRecord] = field(default_factory=list)
    requests: dict[str, Any] = field(default_factory=dict)  # request id -> Request
    _fetch_sig: dict[str, tuple] = field(default_factory=dict)

    def attach(self, engine: Any) -> Collector:
        engine.subscribe(self.on_event)
        # The Request object (arrival, admission, token times, meta["tier"]) is not handed
        # out by generate(); every new request passes scheduler.add, so wrap that.
        sched = engine.testing.scheduler
        add = sched.add

        def tracked_add(req: Any) -> None:
            self.requests[req.request_id] = req
            add(req)

        sched.add = tracked_add
        return self

    def reset(self) -> None:
        """Forget everything recorded so far (after the warm-up)."""
        self.loads.clear()
        self.writes.clear()
        self.requests.clear()

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        now = time.monotonic()
        if event == "adapter_load":
            self._on_load(now, data)
        elif event == "slot_write":
            self.writes.append(
                WriteRecord(
                    data["name"],
                    int(data["slot"]),
                    now,
                    float(data["h2d_s"]),
                    int(data["nbytes"]),
                    data.get("h2d_gpu_s"),
                    data.get("copy_bytes"),
                )
            )

    def _on_load(self, now: float, data: dict[str, Any]) -> None:
        timings = data.get("timings") or {}
        name = data["name"]
        # version.timings keeps the fetch stages of an earlier load when a CPU-evicted adapter
        # is re-staged from its staged files: unchanged values mean those stages did not run.
        sig = tuple(timings.get(s) for s in FETCH_STAGES)
        fresh = sig != self._fetch_sig.get(name) and any(v is not None for v in sig)
        self._fetch_sig[name] = sig
        stages = {s: float(timings.get(s) or 0.0) for s in STAGES}
        if not fresh:
            stages.update(dict.fromkeys(FETCH_STAGES, 0.0))
        total = data.get("total_s")
        if total is None:  # a failed load: the stages that ran
            total = sum(stages.values())
        self.loads.append(
            LoadRecord(
                name=name,
                digest=data.get("digest") or "",
                ok=bool(data.get("ok")),
                t_end=now,
                total_s=float(total),
                nbytes=int(data.get("nbytes") or 0),
                fresh=fresh,
                stages=stages,
                error=data.get("error"),
            )
        )
