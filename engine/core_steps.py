"""The steps part of ``EngineCore`` (core.py): planning a step (or the one chained behind a
step in flight), handing it to the executor, and applying its results to the requests. A
mixin: the state it works on (scheduler, executor, requests in flight, counters) is the
core's, built in ``EngineCore.__init__``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from loraplex.engine.adapters.registry import AdapterRegistry
from loraplex.engine.config import EngineConfig
from loraplex.engine.executor import InFlightStep, StepExecutor
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
    adapters: AdapterRegistry
    executor: StepExecutor
    scheduler: Scheduler
    in_flight: set[Request]
    max_model_len: int
    counters: Any
    device: Any
    fail: Callable[[Request, BaseException], None]  # EngineCore.fail
    finish: Callable[..., None]  # EngineCore.finish
    _log: Callable[[Request], None]  # EngineCore._log
    _poll_slot_events: Callable[[], None]  # AdapterOps
    _drain_failed_adapters: Callable[[], list[tuple[Request, BaseException]]]  # AdapterOps

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
