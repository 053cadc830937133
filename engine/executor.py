"""StepExecutor: runs the engine's steps on the device: inputs, slot writes, forward, sampling.

A step is launched (inputs staged, forward and sampling queued on the GPU) and collected
(sampled tokens copied to the host) separately, so that decode can be pipelined: while step N
runs on the GPU, step N+1 (the same requests, one token further) is planned on the event loop
and queued behind it, reading N's sampled tokens on the device. The host work of a step
(scheduling, input staging, streaming outputs) then overlaps the previous step's GPU time.
``Scheduler.chain`` decides when the next step may be planned before N's tokens are known;
``EngineCore`` applies collected steps to its requests.

Threads: ``prepare`` runs on the event loop; ``launch``, ``collect`` and ``execute`` in the
step thread.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from loraplex.engine.adapters.slot_store import SlotJob, SlotStore
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv import BlockManager
from loraplex.engine.mixed_graphs import MixedGraphs
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model_runner import ModelRunner, StepItem
from loraplex.engine.request import Request
from loraplex.engine.sampler import PendingSample, Sampler, SamplerOutput, min_tokens_banned_ids
from loraplex.engine.scheduler import ScheduledChunk, SchedulerOutput
from loraplex.engine.spec.masks import spec_masks
from loraplex.engine.spec.verify import (
    PendingGreedy,
    PendingVerify,
    VerifyOutput,
    VerifyRow,
    verify,
)
from loraplex.engine.structured.bitmask import fill_masks

__all__ = ["InFlightStep", "StepExecutor", "StepRecord"]


class StepRecord(NamedTuple):
    """One collected step, as kept in ``StepExecutor.step_log`` (read its fields by name)."""

    seconds: float  # from the later of its launch and the previous step's results to its own
    rows: int
    tokens: int
    decode: bool  # every row decodes one token
    loading: bool  # an adapter load was in flight
    gpu_ms: float | None  # CUDA-graph replay time (graph steps only)
    host_s: float  # step-thread seconds to queue the step
    pipelined: bool  # some row read the previous step's tokens on the device
    t_end: float  # perf_counter when its results reached the host
    slot_writes: int  # slot writes issued before its launch
    verify: bool = False  # a speculative verification step (some row checks proposals)


@dataclass(eq=False)
class InFlightStep:
    """A launched step: its plan, the requests of its sampled rows, results on the device."""

    plan: SchedulerOutput
    items: list[StepItem]
    rows: list[Request]  # requests with a sampled row, in row order
    sample: PendingSample | None
    t_start: float  # perf_counter: the step thread began the launch
    t_launched: float  # ... the forward was queued
    events: tuple | None  # CUDA events around the graph replay
    loading: bool  # an adapter load was in flight
    guided: bool = False  # some row samples under a grammar (its matcher takes the token)
    collected: bool = False  # ``collect`` ran (``result`` holds its tokens)
    result: SamplerOutput | VerifyOutput | None = None
    # a step with speculative proposals: its verification (instead of ``sample``)
    verify: PendingVerify | PendingGreedy | None = None
    # sampling not queued yet: its masks are being filled (``StepExecutor.finish`` queues it)
    deferred: Callable[[], PendingSample] | None = None

    @property
    def sampled(self) -> bool:
        """Some row is (or will be, once ``finish``) sampled on the device."""
        return self.sample is not None or self.deferred is not None or self.verify is not None


class StepExecutor:
    """Owns what runs a step: the model runner, the mixed-step CUDA graphs, the sampler and
    the step log (``StepRecord`` per step).

    It reads, never changes, the KV block tables (``blocks``); a step's slot writes go
    through the slot store (``slots``: planned in ``prepare``, issued in ``launch``, done in
    ``collect``); ``loading``: whether an adapter load is in flight (the step log's).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        runner: ModelRunner,
        blocks: BlockManager,
        slots: SlotStore,
        loading: Callable[[], bool] = lambda: False,
        mixed_graphs: MixedGraphs | None = None,
    ) -> None:
        self.model = model
        self.runner = runner
        self.device = model.device
        self.blocks = blocks
        self.slots = slots
        self.loading = loading
        self.sampler = Sampler(seed=config.seed)
        self.mixed_graphs = mixed_graphs  # decode + short prefill steps as graphs (CUDA)
        self.last_step_event: Any = None
        self.last_result_time = 0.0  # perf_counter when the last step's tokens reached the host
        self.step_log: collections.deque[StepRecord] = collections.deque(maxlen=100_000)
        self._fills: ThreadPoolExecutor | None = None  # masks of pipelined steps (``launch``)

    def close(self) -> None:
        """Blocking: stop the mask thread and what the runner started."""
        if self._fills is not None:
            self._fills.shutdown(wait=True)
        self.runner.close()

    def prepare(self, plan: SchedulerOutput, prev: InFlightStep | None = None) -> list[StepItem]:
        """Loop: step items of ``plan``; ``prev``: the step in flight that ``feed`` chunks read."""
        row_of = {id(r): i for i, r in enumerate(prev.rows)} if prev is not None else {}
        items = []
        for c in plan.chunks:
            r = c.req
            table = self.blocks.block_table(r.request_id)
            slot = r.slot
            if c.feed:  # the token at position num_tokens is being sampled by ``prev``
                items.append(StepItem([0], r.num_tokens, table, slot, True, row_of[id(r)]))
                continue
            if c.proposal is not None:  # verification: the last token, then the proposal
                ids = [r.tokens[r.num_computed], *c.proposal.tokens]
                items.append(StepItem(ids, r.num_computed, table, slot, True, num_logits=len(ids)))
                continue
            items.append(
                StepItem(
                    token_ids=r.tokens[r.num_computed : r.num_computed + c.num_tokens],
                    start_pos=r.num_computed,
                    block_table=table,
                    lora_slot=slot,
                    need_logits=c.need_logits,
                )
            )
        # NOTE: invariants of slot safety, checked every step (cheap): a scheduled row reads a
        # slot its version owns and whose write completed; a slot being written has no reader.
        # A row may read a slot written in this very step only as its owner (it joined the
        # step: ``launch`` makes the forward wait for the write; later steps run behind it).
        readers = {c.req.adapter: c.req.slot for c in plan.chunks if c.req.adapter is not None}
        plan.slot_jobs = self.slots.begin(plan.slot_writes, set(readers))
        for v, slot in readers.items():
            assert slot >= 0 and self.slots.readable(v, slot), f"slot {slot} read before its write"
        return items

    def launch(
        self,
        plan: SchedulerOutput,
        items: list[StepItem],
        prev: InFlightStep | None = None,
    ) -> InFlightStep:
        """Step thread: slot writes (side stream), then queue the forward and sampling.

        Sampling under grammars behind a step in flight is deferred (``_defer``): the step is
        returned with its forward queued and its sampling queued later by ``finish``."""
        if prev is not None:
            self.finish(prev)  # (this step's forward reads its sampled tokens)
        if plan.slot_jobs:
            for event in self._issue_slot_writes(plan.slot_jobs, items, prev):
                # rows that joined their slot's write read it after it lands
                torch.cuda.current_stream(self.device).wait_event(event)
        t0 = time.perf_counter()
        if not items:
            return InFlightStep(plan, items, [], None, t0, t0, None, False)
        feed = prev.sample.token_ids if prev is not None and prev.sample is not None else None
        mixed = self.mixed_graphs
        if mixed is not None and mixed.fits(items, feed):
            logits = mixed.run(items, feed)  # decode rows + short prefills, one graph replay
            events = mixed.last_events
        else:
            logits = self.runner.execute(items, feed)
            events = self.runner.last_events if self.runner.last_was_graph else None
        t_launched = time.perf_counter()  # the forward is queued (async on CUDA)
        chunks = [c for c in plan.chunks if c.need_logits]
        rows = [c.req for c in chunks]
        guided = any(r.guide is not None for r in rows)
        if any(c.proposal is not None for c in chunks):  # (never behind a step in flight)
            step = InFlightStep(
                plan, items, rows, None, t0, t_launched, events, self.loading(), guided
            )
            step.verify = self._verify(logits, chunks)
            self._record_event()
            return step
        args = (
            logits,
            [r.params for r in rows],
            [r.generator for r in rows],
            [  # (now: the rows' output_ids grow when ``prev`` is applied)
                min_tokens_banned_ids(r.params, len(r.output_ids) + c.feed, r.eos_ids)
                for r, c in zip(rows, chunks, strict=True)
            ],
        )
        loading = self.loading()
        step = InFlightStep(plan, items, rows, None, t0, t_launched, events, loading, guided)
        if guided and prev is not None and not prev.collected:
            step.deferred = self._defer(args, rows, prev)
        else:
            masks = self._masks(rows, logits.shape[1]) if guided else None
            step.sample = self.sampler.launch(*args, masks=masks)
        self._record_event()
        return step

    def _record_event(self) -> None:
        if self.device.type == "cuda":
            self.last_step_event = torch.cuda.Event()
            self.last_step_event.record()

    def _verify(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk]
    ) -> PendingVerify | PendingGreedy:
        """Step thread: queue the verification of a step with proposals (spec/verify.py):
        per position ``min_tokens`` bans and structured-output masks (``spec_masks``)."""
        vrows = []
        for c in chunks:
            r, prop = c.req, c.proposal
            draft = prop.tokens if prop is not None else []
            done = len(r.output_ids)
            banned = [
                min_tokens_banned_ids(r.params, done + j, r.eos_ids) for j in range(len(draft) + 1)
            ]
            vrows.append(
                VerifyRow(r.params, r.generator, list(draft), prop.probs if prop else None, banned)
            )
        masks = None
        if any(c.req.guide is not None for c in chunks):
            mask, index = spec_masks(chunks, logits.shape[1], pin=self.device.type == "cuda")
            masks = self._upload((mask, index))
        return verify(self.sampler, logits, vrows, masks)

    def _issue_slot_writes(
        self, jobs: list[SlotJob], items: list[StepItem], prev: InFlightStep | None
    ) -> list[Any]:
        """Step thread: a step's slot writes to the store's writer. A write waits for the step
        in flight only when a row of it reads the slot (``prev``: the one step in flight when a
        step is pipelined behind it; every earlier step was collected), e.g. a request aborted
        after ``prev`` was planned, whose slot went back; rows of this step that read a slot
        (they joined its write) wait for the returned events."""
        busy = {it.lora_slot for it in prev.items} if prev is not None else set()
        read = {it.lora_slot for it in items}
        return self.slots.issue(jobs, after=self.last_step_event, busy=busy, read=read)

    def finish(self, step: InFlightStep) -> None:
        """Step thread: queue ``step``'s deferred sampling (waits for its masks' fill)."""
        if step.deferred is not None:
            queue, step.deferred = step.deferred, None
            step.sample = queue()

    def _defer(
        self, args: tuple, rows: list[Request], prev: InFlightStep
    ) -> Callable[[], PendingSample]:
        """Step thread: start filling the masks of a step queued behind ``prev`` and return
        what queues its sampling once they are filled.

        Masks need ``prev``'s tokens, so they are filled only once those reach the host; while
        the mask thread fills them (llguidance computes without the GIL), the step thread
        returns and the loop applies ``prev``'s tokens and plans the next step, so the fill
        overlaps that host work and the forward already queued. The next ``launch`` (or this
        step's ``collect``) calls ``finish``: it waits for the fill and queues the masked
        sampling ahead of the next forward, which reads its tokens."""
        self.collect(prev)
        if self._fills is None:
            self._fills = ThreadPoolExecutor(1, thread_name_prefix="loraplex-masks")
        fill: Future = self._fills.submit(self._fill, rows, args[0].shape[1])

        def queue() -> PendingSample:
            return self.sampler.launch(*args, masks=self._upload(fill.result()))

        return queue

    def _masks(self, rows: list[Request], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step thread: the token bitmasks of this step's constrained rows, on the device,
        filled here (no step is in flight, or its tokens are already in the matchers)."""
        return self._upload(self._fill(rows, vocab))

    def _fill(self, rows: list[Request], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host masks of the constrained rows and their row indices (step or mask thread;
        steps without constrained rows never come here)."""
        idx = [i for i, r in enumerate(rows) if r.guide is not None]
        guides = [rows[i].guide for i in idx]
        cuda = self.device.type == "cuda"
        mask = fill_masks(guides, vocab, sorted(rows[idx[0]].eos_ids), pin=cuda)  # type: ignore[arg-type]
        index = torch.tensor(idx, dtype=torch.long)
        return mask, index.pin_memory() if cuda else index

    def _upload(self, host: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        mask, index = host
        return mask.to(self.device, non_blocking=True), index.to(self.device, non_blocking=True)

    def collect(self, step: InFlightStep) -> SamplerOutput | VerifyOutput | None:
        """Step thread: wait for ``step``'s tokens (only this step's) and log its timing.

        Step time: from the later of the launch and the previous step's results to this
        step's results (pipelined steps overlap, so their launch-to-result spans would not).
        """
        if step.collected:
            return step.result  # collected early, for the masks of the step behind it
        self.finish(step)
        step.collected = True
        if step.plan.slot_jobs:
            self.slots.collected(step.plan.slot_jobs)  # (inline writes are done with it)
        if step.verify is not None:
            return self._collect_verify(step)
        if step.sample is None:
            return None
        out = step.sample.fetch()
        t_end = time.perf_counter()
        if step.guided:
            for r, tok in zip(step.rows, out.token_ids, strict=True):
                if r.guide is not None:
                    r.guide.accept(tok)
        step.result = out
        self._log(step, t_end)
        return out

    def _collect_verify(self, step: InFlightStep) -> VerifyOutput:
        """Step thread: a verification step's emitted tokens (the matchers take each)."""
        assert step.verify is not None
        out = step.verify.fetch()
        t_end = time.perf_counter()
        if step.guided:
            for r, toks in zip(step.rows, out.tokens, strict=True):
                if r.guide is not None:
                    for tok in toks:
                        r.guide.accept(tok)
        step.result = out
        self._log(step, t_end)
        return out

    def _log(self, step: InFlightStep, t_end: float) -> None:
        gpu_ms = step.events[0].elapsed_time(step.events[1]) if step.events else None
        items = step.items
        tokens = sum(len(it.token_ids) for it in items)
        decode = all(len(it.token_ids) == 1 for it in items)
        pipelined = any(it.feed_row >= 0 for it in items)
        self.step_log.append(
            StepRecord(
                t_end - max(step.t_start, self.last_result_time),
                len(items),
                tokens,
                decode,
                step.loading,
                gpu_ms,
                step.t_launched - step.t_start,
                pipelined,
                t_end,
                len(step.plan.slot_jobs),
                step.verify is not None,
            )
        )
        self.last_result_time = t_end

    def execute(
        self, plan: SchedulerOutput, items: list[StepItem]
    ) -> SamplerOutput | VerifyOutput | None:
        """Step thread: launch and collect one step (no pipelining)."""
        return self.collect(self.launch(plan, items))
