"""EngineCore: the engine's state and the one owner of its requests, driven by AsyncEngine.

The core holds the scheduler and KV blocks, the adapter side (``adapters``, an
``AdapterLifecycle``: registry, fetch, staging, slots), the requests in flight, counters and
event listeners, and a ``StepExecutor`` (executor.py) that runs steps on the device. It plans a
step (or the one chained behind a step in flight), hands it to the executor and applies its
results to the requests. Start-up (model, KV cache, tokenizer, graphs, the slot writer) is
``startup.build_core``; nothing here imports it. (Past ~400 lines, still one concept: the
owner of the requests across a step; applying a verified row of speculative decoding is
applying a step.)
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.lifecycle import AdapterChoice, AdapterLifecycle
from loraplex.engine.adapters.slot_writer import InlineWriter, SlotWriter
from loraplex.engine.adapters.version import AdapterState
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.executor import InFlightStep, StepExecutor, StepRecord
from loraplex.engine.kv import BlockManager
from loraplex.engine.loop_lag import LoopLag
from loraplex.engine.mixed_graphs import MixedGraphs
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model.tp import full_config
from loraplex.engine.model_runner import ModelRunner, StepItem
from loraplex.engine.observe import engine_stats, request_summary
from loraplex.engine.output import append_token, append_tokens, final_output
from loraplex.engine.prompt import detokenizer_for, encode_prompt
from loraplex.engine.request import Request
from loraplex.engine.sampler import SamplerOutput, make_generator
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from loraplex.engine.spec.control import Speculation
from loraplex.engine.spec.proposer import Proposer
from loraplex.engine.spec.verify import VerifyOutput
from loraplex.engine.structured.grammars import GrammarCache, Guide
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.engine.tokenizer import Tokenizer

__all__ = ["AdapterChoice", "EngineCore", "EngineInternals", "Planned"]

# A planned step: the scheduler's plan and its step items (the executor's inputs).
Planned = tuple[SchedulerOutput, list[StepItem]]

log = structlog.get_logger("loraplex.engine")


@dataclass(frozen=True)
class EngineInternals:
    """What tests and benchmarks may read or wrap of a running engine (``AsyncEngine.testing``).

    Not an application API: it follows the engine's inner structure.
    ``scheduler``: queues (``running``, ``waiting``), ``schedule`` / ``add``;
    ``adapters``: the ``AdapterLifecycle`` (``registry``: versions; ``slots``: the slot store;
    ``fetcher``: plugins, loader processes, staging dir; ``pool``: the host pool);
    ``executor``: ``prepare`` / ``launch``, ``runner``, ``model``, ``mixed_graphs`` and the
    ``step_log`` of ``StepRecord``.
    """

    scheduler: Scheduler
    adapters: AdapterLifecycle
    executor: StepExecutor

    @property
    def step_log(self) -> collections.deque[StepRecord]:
        return self.executor.step_log


class EngineCore:
    """The engine's state: scheduler, KV blocks, adapters, requests; ``executor`` runs steps.

    ``AsyncEngine`` uses only this API, on the event loop unless noted:

    - lifetime: ``start()`` (on the running loop: loop-lag sampling), ``await close()``;
    - requests: ``submit(request_id, prompt, params, adapter)`` -> the queued ``Request``
      (typed errors for unknown adapters and bad prompts); ``abort(req)`` -> True when it
      finished now, False when a step in flight holds it (that step's ``apply`` ends it);
    - steps: ``drafting()`` -> requests to ``propose_ahead`` in the step thread first (a
      draft model's speculative proposals; usually []);
      ``plan()`` -> the next ``Planned`` step, or None when nothing can run (then
      ``adapters.pending_writes()`` says whether a slot write is about to land);
      ``launch(plan, items, prev)`` and ``collect(step)`` in the step thread;
      ``chain(step)`` -> the ``Planned`` step to queue behind ``step`` while it is in flight
      (pipelined decode), or None; ``apply(step, result, behind)`` a collected step;
      ``end_steps()`` when the loop leaves its steps (also on errors and cancellation);
      ``fail_steps(plans, error)`` / ``fail_all(error)`` when a step / the loop fails;
    - adapters: ``adapters`` (``add``, ``remove``, ``pin``, ``list``, ``residency``,
      ``load_before_tokenizing``);
    - observing: ``subscribe(fn)`` / ``unsubscribe(fn)``, ``stats()``; ``model_name``,
      ``tokenizer``, ``max_model_len``; ``internals`` (the testing hook).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        wake: Callable[[], None],
        pool: HostPool | None = None,
        mixed_graphs: MixedGraphs | None = None,
        writer: SlotWriter | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """``proposer``: speculative decoding's, when start-up built one (the draft model);
        else ``Speculation.from_config`` makes the config's."""
        self.config = config
        self.model = model  # read for its config, dtype and device; run by the executor
        self.tokenizer = tokenizer
        self.device = model.device
        cfg = self.model_config = full_config(model)  # (model.cfg: a TP rank's shard)
        self.model_name = config.served_model_name or config.model or "model"
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer else set(cfg.eos_token_ids)
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self.adapters = AdapterLifecycle(
            config, model, pool=pool, wake=wake, emit=self.emit,
            writer=writer if writer is not None else InlineWriter(runner.write_slot, pool),
            ranks=runner.slot_ranks, generation=runner.slot_buffers.generation,
            prepare_shards=runner.prepare_adapter if runner.tp_size > 1 else None,  # type: ignore[attr-defined]
            base_tokenizer=tokenizer.backend if tokenizer is not None else None,
            load_tokenizer=self._adapter_tokenizer if tokenizer is not None else None,
        )  # fmt: skip
        registry = self.adapters.registry
        self.blocks = BlockManager(
            runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.spec = Speculation.from_config(config, self.max_model_len, proposer)  # None: off
        self.scheduler = Scheduler(config, self.blocks, registry, self.adapters.slots, self.spec)
        self.executor = StepExecutor(
            config, model, runner, self.blocks, self.adapters.slots, registry.any_loading,
            mixed_graphs,
        )  # fmt: skip
        self.in_flight: set[Request] = set()  # requests of launched, not yet applied steps
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "errors": 0, "steps": 0}
        self.loop_lag: LoopLag | None = None  # started by ``start`` on the engine's loop
        self.grammars = (
            GrammarCache(
                tokenizer.backend.to_str,
                cfg.vocab_size + config.lora_extra_vocab_size,  # the logits' width
                sorted(self.eos_ids),
                compile_timeout_s=config.grammar_compile_timeout_s,
                cache_bytes=config.grammar_cache_bytes,
                processes=config.grammar_compile_processes,
            )
            if tokenizer is not None
            else None
        )

    def _adapter_tokenizer(self, folder: Path) -> Tokenizer:
        """An adapter's own tokenizer (it added tokens; loader thread): without a chat template
        of its own, the base's."""
        tok = Tokenizer.from_dir(folder)
        if tok.chat_template is None and self.tokenizer is not None:
            tok.chat_template = self.tokenizer.chat_template
        return tok

    def tokenizer_for(self, adapter: AdapterChoice) -> Tokenizer | None:
        """The tokenizer of requests on ``adapter`` (a name): an adapter that added tokens has
        its own (known once it is loaded ahead), every other request the base's."""
        own = self.adapters.tokenizer_of(adapter) if isinstance(adapter, str) else None
        return own if own is not None else self.tokenizer

    @property
    def internals(self) -> EngineInternals:
        return EngineInternals(self.scheduler, self.adapters, self.executor)

    # -- lifetime and events --------------------------------------------------------------------

    def start(self) -> None:
        """On the engine's running loop: sample its lag (``loop_lag`` events, stats)."""
        self.loop_lag = LoopLag(lambda lag: self.emit("loop_lag", lag_s=lag))
        self.loop_lag.start()

    async def close(self) -> None:
        """Stop lag sampling, the adapter side (loads, slot writer, loader) and the executor."""
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        await self.adapters.close()
        await asyncio.to_thread(self.executor.close)
        if self.grammars is not None:
            await asyncio.to_thread(self.grammars.close)

    def subscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self.listeners.append(fn)

    def unsubscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)

    def emit(self, event: str, **data: Any) -> None:
        """Tell subscribers (metrics, studies) about ``event``; a failing one is logged, not raised."""
        for fn in self.listeners:
            try:
                fn(event, data)
            except Exception:  # noqa: BLE001
                log.exception("listener_failed", event=event)

    def stats(self) -> dict[str, Any]:
        """Counters for tests, metrics and studies (read on the event loop; observe.py)."""
        return engine_stats(self)

    # -- requests -------------------------------------------------------------------------------

    async def guide(self, spec: StructuredOutput) -> Guide:
        """A matcher for a structured-output request (compiled off the loop, cached)."""
        if self.grammars is None:
            raise InvalidRequestError(
                "structured output needs the model's tokenizer", field=spec.field
            )
        return await self.grammars.guide(spec)

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        adapter: AdapterChoice = None,
        guide: Guide | None = None,
        group: str | None = None,
    ) -> Request:
        """Check and queue a request; raises typed errors (unknown adapter, bad prompt...).
        ``adapter``: a name, or a composition [(name, weight), ...] (``AdapterChoice``);
        ``guide``: its matcher when ``params.structured`` is set (``guide()``); ``group``: the
        fair-share group (``Request.group``; None: its own)."""
        version = self.adapters.resolve(adapter)
        try:
            own = version.tokenizer if version is not None else None  # it added tokens
            if own is not None and guide is not None:
                raise InvalidRequestError(
                    f"structured output (response_format, tools) is not supported on adapter "
                    f"{version.name!r}: it adds tokens to the vocabulary",
                    field="response_format",
                )
            prompt_ids = encode_prompt(
                prompt, params, version, tokenizer=self.tokenizer,
                vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                blocks=self.blocks,
            )  # fmt: skip
            req = Request(
                request_id, prompt_ids, params, version,
                eos_ids=frozenset(self.eos_ids), group=group or "",
            )  # fmt: skip
            req.guide = guide
            if params.seed is not None:
                req.generator = make_generator(params.seed, self.device)
            req.detok = detokenizer_for(req, self.tokenizer)
        except BaseException:
            if version is not None:
                self.adapters.drop_unused(version)  # a rejected request registers no name
            raise
        if version is not None:
            req.meta["tier"] = self.adapters.registry.add_user(version)
        self.counters["requests"] += 1
        self.scheduler.add(req)
        return req

    def abort(self, req: Request) -> bool:
        """Mark ``req`` aborted; True if it finished now, False if a step in flight holds it
        (applying that step finishes it)."""
        req.aborted = True
        if req in self.in_flight:
            return False
        self.finish(req, "abort")
        return True

    def finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        self.scheduler.finish(req, reason)
        self.counters["aborted" if reason == "abort" else "finished"] += 1
        req.queue.put_nowait(final_output(req, reason, error))
        self._log(req)

    def fail(self, req: Request, error: BaseException) -> None:
        self.counters["errors"] += 1
        self.finish(req, "error", error)

    def fail_all(self, error: BaseException) -> None:
        """Fail every queued and running request (the step loop hit an unexpected error)."""
        self.in_flight.clear()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self.fail(req, error)

    def _log(self, req: Request) -> None:
        """The one canonical log line of a request, and the matching event for subscribers."""
        summary = request_summary(req)
        log.info("request", **summary)
        times = req.token_times
        self.emit(
            "request_finished", **summary, itl_s=[b - a for a, b in itertools.pairwise(times)]
        )

    def _land(self) -> None:
        """Loop: landed slot writes are noted; a slot write that failed fails the requests
        waiting on its adapter."""
        for v, error in self.adapters.land():
            for req in [r for r in self.scheduler.waiting if r.adapter is v]:
                self.fail(req, error)

    def _fail_failed_loads(self) -> None:
        """Loop: requests waiting on an adapter whose load failed get its error; the version
        may be retried by later requests (a dynamic one is forgotten)."""
        waiting = self.scheduler.waiting
        failed = [r for r in waiting if r.adapter and r.adapter.state is AdapterState.FAILED]
        for req in failed:
            self.fail(req, req.adapter.error or RuntimeError("adapter load failed"))  # type: ignore[union-attr]
        for v in {id(r.adapter): r.adapter for r in failed}.values():
            self.adapters.registry.reset_failed(v)  # type: ignore[arg-type]

    # -- steps ----------------------------------------------------------------------------------

    def plan(self) -> Planned | None:
        """The next step (its requests are in flight from here), or None: nothing can run.

        First: landed slot writes, requests whose adapter failed to load, and requests the
        scheduler rejects are dealt with."""
        self._land()
        self._fail_failed_loads()
        plan = self.scheduler.schedule()
        for req, err in plan.failed:
            self.fail(req, err)
        if plan.empty:
            return None
        self.in_flight |= {c.req for c in plan.chunks}
        return plan, self.executor.prepare(plan)

    def drafting(self) -> list[Request]:
        """The requests the proposer proposes for in the step thread before the next ``plan``
        (a proposer that runs a model, spec/control.py), or []: none, or nothing to do."""
        spec = self.spec
        if spec is None or not spec.ahead or self.in_flight:
            return []
        return spec.asking(self.scheduler.running)

    def propose_ahead(self, reqs: list[Request]) -> None:
        """Step thread (no step in flight): the proposals of ``reqs`` (``drafting``) for the
        next ``plan``. A failing proposer costs the step its proposals, never the requests."""
        assert self.spec is not None
        try:
            self.spec.propose_ahead(reqs)
        except Exception:  # noqa: BLE001 - speculation only saves time: decode without it
            log.exception("propose_failed", requests=len(reqs))

    def chain(self, step: InFlightStep) -> Planned | None:
        """The step to queue behind ``step`` while it is in flight (pipelined decode and
        admission), if ``Scheduler.chain`` allows one."""
        self._land()
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

    def collect(self, step: InFlightStep) -> SamplerOutput | VerifyOutput | None:
        """Step thread: wait for ``step``'s sampled tokens."""
        return self.executor.collect(step)

    def apply(
        self,
        step: InFlightStep,
        result: SamplerOutput | VerifyOutput | None,
        behind: InFlightStep | None = None,
    ) -> None:
        """Apply a collected step (tokens, finishes, streamed outputs). ``behind``: the step
        launched behind it and still in flight; its requests stay in flight, no others do."""
        if behind is None:
            self.in_flight.clear()
        else:
            self.in_flight = {c.req for c in behind.plan.chunks}
        self.counters["steps"] += 1
        row = -1
        now = time.monotonic()
        for chunk in step.plan.chunks:
            req = chunk.req
            row += chunk.need_logits
            if req.is_finished:
                continue  # e.g. a pipelined row of a request that ended the step before
            if isinstance(result, VerifyOutput) and chunk.need_logits:
                self._apply_verified(chunk, result, row, now)
                continue
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

    def _apply_verified(
        self, chunk: ScheduledChunk, result: VerifyOutput, row: int, now: float
    ) -> None:
        """A sampled row of a verification step: its emitted tokens one by one (stops,
        ``max_tokens`` and the model length end it at the right one; one streamed chunk), its
        KV rolled back past the kept tokens (``Scheduler.mark_verified``)."""
        req = chunk.req
        accepted = result.accepted[row]
        spec_row = chunk.proposal is not None
        if req.aborted:
            if spec_row:
                self.scheduler.mark_verified(chunk, 1)  # (the input token's KV only)
            else:
                self.scheduler.mark_computed(chunk)
            self.finish(req, "abort")
            return
        out, n = append_tokens(
            req, result.tokens[row], result.logprobs[row], result.top_logprobs[row],
            self.max_model_len, now,
        )  # fmt: skip
        if spec_row and self.spec is not None:  # (counts; the proposer's commit, after append)
            self.spec.verified(req, len(chunk.proposal.tokens), accepted)  # type: ignore[union-attr]
        # KV kept: the input token and the emitted tokens but the last (as step by step)
        if spec_row:
            self.scheduler.mark_verified(chunk, n)
        else:  # a row without a proposal (a decode or a prefill's last chunk)
            self.scheduler.mark_computed(chunk)
        if out.finished:
            self.scheduler.finish(req, out.finish_reason or "stop")
            self.counters["finished"] += 1
            self._log(req)
        req.queue.put_nowait(out)

    def end_steps(self) -> None:
        """The loop left its steps (collected, failed or cancelled): none is in flight."""
        self.in_flight.clear()

    def fail_steps(self, plans: list[SchedulerOutput], error: BaseException) -> None:
        """Fail the requests of steps that raised (pipelined steps share requests)."""
        for plan in plans:
            for chunk in plan.chunks:
                if not chunk.req.is_finished:
                    self.fail(chunk.req, error)
