"""The steps part of ``EngineCore`` (core.py): planning a step (or the one chained behind a
step in flight), handing it to the executor, and applying its results to the requests. A
mixin: the state it works on (scheduler, executor, requests in flight, counters) is the
core's, built in ``EngineCore.__init__``."""

from __future__ import annotations

import collections
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from loraplex.engine.config import EngineConfig
from loraplex.engine.executor import InFlightStep, StepExecutor
from loraplex.engine.lora.manager import AdapterManager, AdapterState
from loraplex.engine.model_runner import StepItem
from loraplex.engine.output import append_token
from loraplex.engine.request import Request
from loraplex.engine.sampler import SamplerOutput
from loraplex.engine.scheduler import Scheduler, SchedulerOutput

__all__ = ["Planned", "StepOps"]

# A planned step: the scheduler's plan and its step items (the executor's inputs).
Planned = tuple[SchedulerOutput, list[StepItem]]


class StepOps:
    """``EngineCore``'s step methods (see the module docstring)."""

    config: EngineConfig
    adapters: AdapterManager
    executor: StepExecutor
    scheduler: Scheduler
    in_flight: set[Request]
    max_model_len: int
    counters: Any
    device: Any
    plan_lags: collections.deque[float]  # the last few ``note_plan_lag`` seconds
    _sync_slot_writes: bool
    fail: Callable[[Request, BaseException], None]  # EngineCore.fail
    finish: Callable[..., None]  # EngineCore.finish
    _log: Callable[[Request], None]  # EngineCore._log
    _poll_slot_events: Callable[[], None]  # AdapterOps
    _drain_failed_adapters: Callable[[], list[tuple[Request, BaseException]]]  # AdapterOps
    _slot_landed: Callable[[Any], None]  # AdapterOps

    def plan(self) -> Planned | None:
        """The next step (its requests are in flight from here), or None: nothing can run.

        First: landed slot writes, requests whose adapter failed to load, and requests the
        scheduler rejects are dealt with."""
        self._poll_slot_events()
        for req, err in self._drain_failed_adapters():
            self.fail(req, err)
        plan = self.scheduler.schedule()
        for req, err in plan.failed:
            self.fail(req, err)
        if plan.empty:
            return None
        self.in_flight |= {c.req for c in plan.chunks}
        return plan, self.executor.prepare(plan)

    def chain(self, step: InFlightStep) -> Planned | None:
        """The step to queue behind ``step`` while it is in flight (pipelined decode and
        admission), if ``Scheduler.chain`` allows one."""
        self._poll_slot_events()
        if not self.config.async_scheduling or not step.sampled:
            return None
        plan = self.scheduler.chain(step.plan, self.max_model_len)
        if plan is None:
            return None
        for req, err in plan.failed:  # (every GPU slot pinned: as from ``plan``)
            self.fail(req, err)
        self.in_flight |= {c.req for c in plan.chunks}
        return plan, self.executor.prepare(plan, step)

    def chain_deadline(self) -> float | None:
        """Loop, between applying a step and chaining the next one behind the step in flight:
        the ``perf_counter`` time until which planning may wait for a cold load to land
        (``late_chain_margin_ms``), or None: plan now.

        Planning the chained step at once (as steady decode does) leaves a load landing during
        the step in flight to the step after next: its request's first token comes 2-3 steps
        after the load. Planned late, the next step takes it: 1-2 steps. The deadline is the
        step in flight's expected end (the previous results' time plus the recent GPU time of
        a step's replay) less the recent longest launch (host) time, the recent longest plan
        lag of a held-back plan (from when it was due to its launch starting: the loop resuming
        late, planning, the hop to the step thread; ``note_plan_lag``) and the margin, so the
        chained step is still queued before the GPU runs dry. GPU time, not the period between
        results: a period that a late launch stretched would push the next deadline later
        still. Only on CUDA (a CPU launch computes its step), only while some waiting request's
        adapter is loading, and only once a few pipelined graph steps give a GPU time."""
        margin = self.config.late_chain_margin_ms
        if margin is None or self.device.type != "cuda" or not self.config.async_scheduling:
            return None
        if not any(
            r.adapter is not None and r.adapter.state is AdapterState.LOADING
            for r in self.scheduler.waiting
        ):
            return None
        ex = self.executor
        recent = [
            s
            for s in itertools.islice(reversed(ex.step_log), 8)
            if s.pipelined and s.gpu_ms is not None
        ]
        if len(recent) < 3:
            return None
        gpu = statistics.median(s.gpu_ms for s in recent) / 1e3
        host = max(s.host_s for s in recent)
        lag = max(self.plan_lags, default=0.0)
        deadline = ex.last_result_time + gpu - host - lag - margin / 1e3
        return deadline if deadline > time.perf_counter() else None

    def note_plan_lag(self, seconds: float) -> None:
        """Loop: a held-back plan was due ``seconds`` before its launch began (the deadlines
        allow for the longest of the recent ones)."""
        self.plan_lags.append(seconds)

    def note_chain_wait(self, seconds: float, landed: bool) -> None:
        """Loop: a wait of ``chain_deadline`` ended, by a landing (or another wake) or not."""
        self.counters["late_chain_waits"] += 1
        self.counters["late_chain_woken"] += landed
        self.counters["late_chain_wait_us"] += int(seconds * 1e6)

    def launch(
        self, plan: SchedulerOutput, items: list[StepItem], prev: InFlightStep | None = None
    ) -> InFlightStep:
        """Step thread: slot writes, then queue the forward and sampling (behind ``prev``)."""
        return self.executor.launch(plan, items, prev)

    def collect(self, step: InFlightStep) -> SamplerOutput | None:
        """Step thread: wait for ``step``'s sampled tokens."""
        return self.executor.collect(step)

    def apply(
        self,
        step: InFlightStep,
        result: SamplerOutput | None,
        behind: InFlightStep | None = None,
    ) -> None:
        """Apply a collected step (tokens, finishes, streamed outputs). ``behind``: the step
        launched behind it and still in flight; its requests stay in flight, no others do."""
        if behind is None:
            self.in_flight.clear()
        else:
            self.in_flight = {c.req for c in behind.plan.chunks}
        self._postprocess(step.plan, result)

    def end_steps(self) -> None:
        """The loop left its steps (collected, failed or cancelled): none is in flight."""
        self.in_flight.clear()

    def fail_steps(self, plans: list[SchedulerOutput], error: BaseException) -> None:
        """Fail the requests of steps that raised (pipelined steps share requests)."""
        for plan in plans:
            for chunk in plan.chunks:
                if not chunk.req.is_finished:
                    self.fail(chunk.req, error)

    def _postprocess(self, plan: SchedulerOutput, result: SamplerOutput | None) -> None:
        self.counters["steps"] += 1
        if self._sync_slot_writes:
            for v, slot, _ in plan.slot_jobs:
                if v.slot == slot and self.adapters.slot_owner(slot) is v:  # not dropped meanwhile
                    self._slot_landed(v)
        row = -1
        now = time.monotonic()
        for chunk in plan.chunks:
            req = chunk.req
            row += chunk.need_logits
            if req.is_finished:
                continue  # e.g. a pipelined row of a request that ended the step before
            self.scheduler.mark_computed(chunk)
            if req.aborted:
                self.finish(req, "abort")
                continue
            if not chunk.need_logits:
                continue
            assert result is not None
            tok = result.token_ids[row]
            out = append_token(
                req, tok, result.logprobs[row], result.top_logprobs[row], self.max_model_len
            )
            req.token_times.append(now)
            if out.finished:
                self.scheduler.finish(req, out.finish_reason or "stop")
                self.counters["finished"] += 1
                self._log(req)
            req.queue.put_nowait(out)
