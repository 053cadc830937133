"""Continuous-batching scheduler: pure Python objects, never touches tensors.

Policy (one step):
1. Running requests first, oldest first. A request still in prefill gets its next chunk, a
   decoding one gets one token. When KV blocks run out, the youngest running request is
   preempted by recompute: its blocks are freed and it goes back to the head of the queue.
2. Then waiting requests (FIFO; a request waiting longer than ``starvation_timeout_s`` goes
   first) are admitted while the token budget (``max_num_batched_tokens``), the sequence
   budget (``max_num_seqs``) and free blocks allow. Prompts longer than the budget are
   prefilled in chunks over several steps, mixed with decodes (chunked prefill): decodes
   never wait behind a long prompt.
3. A request whose adapter is not in a usable GPU slot yet is skipped, not waited on: its load
   runs in the background and others go ahead. In a step chained behind one in flight
   (4.), one whose slot write is issued in this very step joins it: the write overlaps the
   step in flight and the new step waits for it on the device (while the step's joined
   writes stay within ``slot_write_join_bytes`` and no earlier write is still landing). At most ``max_loras`` distinct adapters are in
   a step (one slot each). If a starved request is held back only because every slot is
   referenced, no further requests are admitted until a slot drains, so it cannot starve.
4. ``chain`` plans the step after one in flight (pipelined decode): its rows decode the tokens
   the step in flight samples, and waiting requests are admitted and loaded adapters given
   slots by the same rules (2, 3), so adapters landing mid-decode do not pause pipelining.
5. Speculative decoding (``spec``, spec/control.py): while few requests run, decoding rows get
   the proposer's tokens and become (1 + k)-token rows (``ScheduledChunk.proposal``); their KV
   blocks are grown for every proposed position (a row whose blocks are short drops its
   proposal, never preempts for it) and rolled back after verification (``mark_verified``).
   Such steps are not chained: the next proposal needs this step's tokens on the host; a step
   whose rows would all go without a proposal next (requests backing off, spec/backoff.py) is.
6. Fair share between groups (the sibling requests of one API request: its ``n`` choices and
   prompts, ``Request.group``; fair_share.py): while two or more groups have requests queued,
   a group's fair number of running sequences is max(1, max_num_seqs // groups). Before step
   1, a waiting request of a group below its share that finds no free seat preempts the
   youngest sequence of a group above its share (an ``n=128`` request holding every seat
   without ``max_tokens`` would otherwise keep them for the whole context length; a group
   within its share is never preempted for this). In 2, requests of groups below their share
   are admitted first, the others after them with what is left (a lone group still gets every
   seat); the starved request that goes first is one of a group below its share. In 1, KV
   preemption takes the youngest sequence of a group above its share first. A step that such
   a preemption is due to is not chained (``schedule`` decides it).

Past ~400 lines, still one concept: which rows a step runs and what KV they hold (the
speculative rows' proposals, blocks and rollback are the same decision).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from loraplex.engine.adapters.registry import AdapterRegistry, AdapterState, AdapterVersion
from loraplex.engine.adapters.slot_store import SlotJob, SlotStore
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import SlotFullError
from loraplex.engine.fair_share import FairShare
from loraplex.engine.kv import BlockManager
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.spec.control import Speculation
from loraplex.engine.spec.proposer import Proposal

__all__ = ["Scheduler", "ScheduledChunk", "SchedulerOutput"]

# where a waiting request's adapter stands (``Scheduler._adapter_stage``)
_READY, _FAILED, _LOADING, _NO_SLOT, _WRITING = range(5)


@dataclass
class ScheduledChunk:
    req: Request
    num_tokens: int
    need_logits: bool  # the chunk reaches the last known token: sample after it
    # pipelined decode: the one input token is the one the step in flight samples; the chunk
    # starts at position ``req.num_tokens`` (as of scheduling) and reads it on the device
    feed: bool = False
    # speculative decoding: the row's one known input token, then these proposed tokens
    # (``num_tokens`` = 1 + len(proposal.tokens)); logits at every position
    proposal: Proposal | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    slot_writes: list[AdapterVersion] = field(default_factory=list)
    # each write's job (slot_store.py), taken on the event loop before the step thread runs
    # (``StepExecutor.prepare``): a version dropped meanwhile (its last request cancelled)
    # loses its slot and tensors, the job keeps what it writes
    slot_jobs: list[SlotJob] = field(default_factory=list)
    failed: list[tuple[Request, BaseException]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.slot_writes


class Scheduler:
    """The waiting and running queues and the choice of each step's rows (event loop only).

    The engine core calls ``add`` (a new request), ``schedule`` (the next step), ``chain``
    (the next decode step while one is in flight), ``mark_computed`` (after a step) and
    ``finish`` (end, abort or failure), and may read ``has_work``, ``waiting``, ``running``
    and ``num_preemptions``. KV blocks come from ``blocks``, loads and users from the adapter
    registry ``adapters``, slot assignment and references from the slot store ``slots``;
    requests failed on their adapter are handed back in ``SchedulerOutput.failed`` (the
    caller fails them).
    """

    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        adapters: AdapterRegistry,
        slots: SlotStore | None = None,
        spec: Speculation | None = None,
    ):
        self.config = config
        self.spec = spec  # speculative decoding (None: off)
        self.blocks = blocks
        self.adapters = adapters
        self.slots = slots if slots is not None else adapters.slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.fair = FairShare(config.max_num_seqs)  # running / queued requests per group

    def add(self, req: Request) -> None:
        """Queue a new request (waiting, FIFO). Its adapter user count is the caller's."""
        self.waiting.append(req)
        self.fair.added(req)

    @property
    def has_work(self) -> bool:
        """Some request is waiting or running."""
        return bool(self.waiting or self.running)

    # -- step -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step (the policy in the module docstring): chunks of running and newly
        admitted requests, slot writes that must precede them, and waiting requests failed on
        their adapter (removed from the queue; the caller fails them). Takes the KV blocks
        and slot references of what it schedules; may preempt running requests."""
        out = SchedulerOutput()
        # 5. seats owed to groups below their fair share
        for victim in self.fair.victims(self.running, self.waiting, self._admissible):
            self._preempt(victim)
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()
        timeout = self.config.starvation_timeout_s
        share = self.fair.share()
        # (a starved sibling of a group holding its share would take back the seat just freed)
        head = next(
            (
                r
                for r in self.waiting
                if now - r.arrival > timeout and not self.fair.full(r.group, share)
            ),
            None,
        )
        self._collect_slot_writes(out, head)
        if head is not None and head not in self.waiting:
            head = None  # it failed
        # 1. running requests
        scheduled: list[Request] = []
        queue = list(self.running)
        proposals = self._proposals(queue)
        while queue and budget > 0:
            req = queue.pop(0)
            n = min(req.num_tokens - req.num_computed, budget)
            prop = proposals.pop(id(req), None)
            if prop is not None:
                m = min(len(prop.tokens), budget - 1)
                if m > 0 and self._grow(req, req.num_computed + 1 + m):
                    cut = prop.probs[:m] if prop.probs is not None else None
                    out.chunks.append(
                        ScheduledChunk(req, 1 + m, True, proposal=Proposal(prop.tokens[:m], cut))
                    )
                    scheduled.append(req)
                    budget -= 1 + m
                    continue
            while not self._grow(req, req.num_computed + n):
                i = self.fair.kv_victim(queue, req)  # the youngest, above-share groups first
                if i is None:
                    self._preempt(req)
                    req = None
                    break
                self._preempt(queue.pop(i))
            if req is None:
                break
            out.chunks.append(ScheduledChunk(req, n, req.num_computed + n == req.num_tokens))
            scheduled.append(req)
            budget -= n
        # 2. waiting requests (nothing is in flight for a slot write to overlap: no joins)
        self._admit(out, head, budget, len(scheduled), join=False)
        return out

    def _proposals(self, running: list[Request]) -> dict[int, Proposal]:
        """Speculative proposals of the decoding ``running`` requests (by ``id``), when this
        step speculates (spec/control.py: few requests run)."""
        spec = self.spec
        if spec is None or not spec.active(len(running)):
            return {}
        return spec.propose([r for r in running if r.num_computed == r.num_tokens - 1])

    def _admit(
        self, out: SchedulerOutput, head: Request | None, budget: int, seqs: int, *, join: bool
    ) -> None:
        """Step 2 of ``schedule``: admit waiting requests (``head`` first, then groups below
        their fair share, then the rest) into ``out`` while the token ``budget``, the sequence
        budget (``seqs`` already in the step) and free blocks allow; a request whose adapter
        failed goes to ``out.failed``. ``join``: a request may join the step that writes its
        slot (``_joinable_writes``)."""
        order = ([head] if head else []) + [r for r in self.waiting if r is not head]
        joinable = self._joinable_writes(out) if join else set()
        share = self.fair.share()
        deferred: list[Request] = []  # of groups holding their share: after the others
        for batch in (order, deferred):
            for req in batch:
                if budget <= 0 or seqs >= self.config.max_num_seqs:
                    return
                if batch is order and self.fair.full(req.group, share):
                    deferred.append(req)
                    continue
                admitted = self._admit_one(out, req, head, joinable, budget)
                if admitted is None:
                    return
                if admitted:
                    seqs += 1
                    budget -= out.chunks[-1].num_tokens

    def _admit_one(
        self,
        out: SchedulerOutput,
        req: Request,
        head: Request | None,
        joinable: set[int],
        budget: int,
    ) -> bool | None:
        """Admit ``req`` with a chunk of at most ``budget`` tokens: True; False: skipped (its
        adapter is not ready, or failed: then it is in ``out.failed``); None: admit no more
        requests this step (no blocks for it, or the starved ``head`` waits on a slot)."""
        v = req.adapter
        if v is not None:
            stage = self._adapter_stage(v)
            if stage == _FAILED:
                self.waiting.remove(req)
                out.failed.append((req, v.error or RuntimeError("adapter load failed")))
                return False
            if stage == _WRITING and id(v) in joinable:
                stage = _READY  # joins the step that writes its slot
            if stage != _READY:
                # let slots drain for the starved request
                return None if req is head else False
        if not self.blocks.can_allocate(req.request_id, req.tokens, req.adapter_key):
            return None  # FIFO on memory: later requests would only take blocks it needs
        cached = self.blocks.allocate(req.request_id, req.tokens, req.adapter_key)
        req.num_computed = req.num_cached = cached
        n = min(req.num_tokens - cached, budget)
        self.waiting.remove(req)
        self.running.append(req)
        self.fair.started(req)
        req.status = RequestStatus.RUNNING
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        if req.adapter is not None:
            req.slot = self.slots.acquire(req.adapter)
        out.chunks.append(ScheduledChunk(req, n, cached + n == req.num_tokens))
        return True

    def _admissible(self, req: Request) -> bool:
        """A waiting request could be admitted now, seats and blocks aside: its adapter (if
        any) is in a written GPU slot (fair-share preemption frees seats only for such)."""
        return req.adapter is None or self._adapter_stage(req.adapter) == _READY

    def chain(self, plan: SchedulerOutput, max_model_len: int) -> SchedulerOutput | None:
        """The next step after ``plan`` while ``plan`` is still in flight, or None where a
        normal ``schedule`` must decide.

        Each of ``plan``'s requests decodes the token ``plan`` samples (unknown yet: ``feed``).
        Waiting requests ride along as ``schedule`` would admit them (pipelined admission: a
        request whose adapter slot is written joins with its prefill chunk, loaded adapters get
        their slots, the writes run on the side stream, overlapping ``plan``, and requests may
        join the step that writes their slot), so a storm of cold loads landing does
        not stop pipelined decode for a step per request. Chains only when: every chunk of
        ``plan`` samples, every running request is in it, no waiting request is starved or has
        a failed adapter, and the rows' next KV blocks are free without preemption. A request
        that ``plan``'s token ends by length is left out; one that ends by EOS or a stop
        string costs one discarded row. Requests whose slot cannot be had at all (every slot
        pinned) come back in ``failed``, as from ``schedule``.
        """
        if not plan.chunks or not all(c.need_logits for c in plan.chunks):
            return None
        if self.spec is not None and (
            self.spec.wanted_after(self.running) or any(c.proposal for c in plan.chunks)
        ):
            return None  # speculation proposes from the tokens ``plan`` samples (5.)
        in_plan = {id(c.req) for c in plan.chunks}
        if any(id(r) not in in_plan for r in self.running):
            return None
        now = time.monotonic()
        for r in self.waiting:
            if now - r.arrival > self.config.starvation_timeout_s:
                return None  # the starvation policy (forced slots, admission order) applies
            if r.adapter is not None and r.adapter.state is AdapterState.FAILED:
                return None
        if self.waiting and self.fair.victims(self.running, self.waiting, self._admissible):
            return None  # a fair-share preemption is due (5.): ``schedule`` makes it
        rows = [
            c.req
            for c in plan.chunks
            if not (c.req.is_finished or c.req.aborted or c.req.status is not RequestStatus.RUNNING)
            # a request whose token in flight is its last is left out
            and len(c.req.output_ids) + 1 < c.req.params.max_tokens
            and c.req.num_tokens + 1 < max_model_len
        ]
        extra = sum(
            self.blocks.blocks_needed(r.num_tokens + 1) - len(self.blocks.block_table(r.request_id))
            for r in rows
        )
        if not rows or extra > self.blocks.num_free_blocks:
            return None  # (checked first: no request takes a block it would hold idle)
        for r in rows:
            self.blocks.append(r.request_id, r.num_tokens + 1)
        if self.spec is not None and self.spec.active(len(self.running)):
            self.spec.count_backoff(rows, 1)  # (each backs off or opted out: else no chain)
        out = SchedulerOutput([ScheduledChunk(r, 1, True, feed=True) for r in rows])
        if self.waiting:
            self._collect_slot_writes(out, None)
            budget = self.config.max_num_batched_tokens - len(rows)
            # (rows left out still run)
            self._admit(out, None, budget, len(self.running), join=True)
        return out

    def _collect_slot_writes(self, out: SchedulerOutput, head: Request | None) -> None:
        """Assign slots to loaded adapters that waiting requests need (writes run in the step)."""
        order = ([head] if head else []) + [r for r in self.waiting if r is not head]
        # slot ranges in which a non-forced assign found nothing to take: the same answer for
        # every later version of that range in this pass (thousands of waiting requests would
        # each scan the slots again)
        taken_up: set[range] = set()
        for req in order:
            v = req.adapter
            if v is None or v.state is not AdapterState.CPU or self.slots.slot_of(v) is not None:
                continue
            force = req is head
            usable = self.slots.usable(v)
            if not force and usable in taken_up:
                continue
            try:
                slot = self.slots.assign(v, force=force)
            except SlotFullError as e:
                out.failed.append((req, e))
                continue
            if slot is not None:
                out.slot_writes.append(v)
            elif not force:
                taken_up.add(usable)
        for req, _ in out.failed:
            self.waiting.remove(req)

    def _joinable_writes(self, out: SchedulerOutput) -> set[int]:
        """ids of the versions whose slot write ``out`` issues and whose requests may join
        ``out`` itself: the first writes within ``slot_write_join_bytes``, and none while an
        earlier write is still landing (the step would wait behind it on the device)."""
        budget = self.config.slot_write_join_bytes
        if not out.slot_writes or budget <= 0:
            return set()
        if self.slots.landing_besides(out.slot_writes):
            return set()
        joinable = set()
        for v in out.slot_writes:
            size = v.adapter.nbytes if v.adapter is not None else 0
            if size > budget:
                break
            budget -= size
            joinable.add(id(v))
        return joinable

    def _adapter_stage(self, v: AdapterVersion) -> int:
        """Where a waiting request's adapter stands on its way to admission: ``_READY`` (its
        GPU slot is written), ``_FAILED``, ``_LOADING`` (not in the CPU tier yet; starts the
        load if none runs, single-flight), ``_NO_SLOT`` (in the CPU tier, no GPU slot) or
        ``_WRITING`` (its slot write has not landed). The one adapter check of admission:
        ``schedule`` and ``chain`` (through ``_admit``) both decide on it."""
        state = v.state
        if state is AdapterState.CPU:
            if self.slots.slot_of(v) is None:
                return _NO_SLOT
            return _READY if self.slots.is_ready(v) else _WRITING
        if state is AdapterState.FAILED:
            return _FAILED
        if state is not AdapterState.LOADING:
            self.adapters.ensure_loaded(v)
        return _LOADING

    def _grow(self, req: Request, num_tokens: int) -> bool:
        table = self.blocks.block_table(req.request_id)
        extra = self.blocks.blocks_needed(num_tokens) - len(table)
        if extra > self.blocks.num_free_blocks:
            return False
        self.blocks.append(req.request_id, num_tokens)
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the KV, requeue at the head."""
        self.running.remove(req)
        self.fair.stopped(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if self.spec is not None:
            self.spec.release(req)
        if req.request_id in self.blocks:
            self.blocks.free(req.request_id)
        if req.slot >= 0 and req.adapter is not None:
            self.slots.release(req.adapter)
            req.slot = -1

    # -- after the step -------------------------------------------------------------------------

    def finish(self, req: Request, reason: str) -> None:
        """Remove ``req`` from the queues and return everything it holds."""
        if req.status is RequestStatus.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
            self.fair.stopped(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.fair.left(req)
        self._release(req)
        if req.adapter is not None:
            self.adapters.drop_user(req.adapter)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def mark_computed(self, chunk: ScheduledChunk) -> None:
        """After the step ran ``chunk``: its tokens' KV is written (full blocks join the
        prefix cache)."""
        req = chunk.req
        req.num_computed += chunk.num_tokens
        if req.request_id in self.blocks:
            self.blocks.mark_computed(req.request_id, req.tokens, req.num_computed)

    def mark_verified(self, chunk: ScheduledChunk, kept: int) -> None:
        """After verification of ``chunk`` (a row with a proposal) and the core appended its
        emitted tokens: the KV of its first ``kept`` positions counts as computed (the input
        token and the kept proposal tokens; full blocks join the prefix cache); the blocks past
        them, which only rejected tokens wrote into, go back (their positions are written
        again before any read)."""
        req = chunk.req
        req.num_computed += kept
        if req.request_id in self.blocks:
            self.blocks.truncate(req.request_id, req.num_computed)
            self.blocks.mark_computed(req.request_id, req.tokens, req.num_computed)
