"""The GPU slots' one owner: which version holds each slot, the running requests reading it,
the write in flight and its landing, and what each slot holds (rank, DoRA, which regions are
zero). One concept, ~400 lines with the full-table and expert-slot placement rules: every
question about a slot is answered here, so that no other module writes slot state.

Ownership. Slots ``0 .. num_full - 1`` also hold full tables (model/lora/full.py): the only
ones an adapter with modules_to_save tables may take; slots ``0 .. num_expert - 1`` (None:
every slot) hold expert LoRA storage on a MoE base (model/moe/expert_lora.py): the only ones an
adapter with LoRA on the experts may take. An adapter takes a free slot with the fewest such
capacities it does not need (then the lowest), so plain adapters take them last. A slot is
taken from its owner only when the owner is idle: no running request reads it (``refs`` 0),
its write has landed, no operator pin holds it, and (unless ``force``: a starved request needs
a slot) no request waits for it; among idle owners the eviction policy (``eviction``,
adapters/eviction.py; default: the least recently used) picks the one that loses its slot
(``on_taken`` tells the registry, which counts the eviction and trims the CPU tier). ``use``
records every use of a version (a request admitted, a slot assigned, a request reading it) for
the policy, and for the registry's through ``on_use``; ``free`` makes the policy forget a
version that gives its slot back for good.

Writes, the one path. On the event loop, ``begin`` (from ``StepExecutor.prepare``) makes a
``SlotJob`` per write a step plans: a snapshot of the version's adapter and host-pool region
(held until the copy is issued, host_pool.py) with the decisions that depend on what the slot
holds (``zero_rest``: the regions the adapter's layout does not fill must be zeroed;
``had_dora``: its DoRA scales must be reset), and sets the slot's rank and DoRA flag for the
steps (``SlotRanks``). In the step thread ``issue`` hands every job to the writer
(slot_writer.py): ``ThreadWriter`` on CUDA with one rank (side stream, paced, events),
``InlineWriter`` on the CPU and under tensor parallelism (now, on the current stream); a
write waits for the step in flight only when that step reads the slot. ``collected`` marks a
collected step's inline jobs done. Back on the loop, ``poll`` turns the writes that landed
into ``Landed`` records and their versions' slots ready.

Writes to one slot are issued in order on one stream, so a decision may rely on the job
before it; a job that failed leaves what its slot holds unknown (the next write zero-fills and
resets DoRA). Event loop only, except ``issue`` and ``collected`` (step thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.adapters.eviction import EvictionPolicy, tier_policy
from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.slot_writer import InlineWriter, SlotJob, SlotWriter
from loraplex.engine.adapters.version import (
    AdapterState,
    AdapterVersion,
    _has_experts,
    _has_full,
)
from loraplex.engine.errors import SlotFullError
from loraplex.engine.model.lora.ranks import SlotRanks

__all__ = ["Landed", "SlotFullError", "SlotJob", "SlotStore"]

_CLEAR = "clear"  # what a slot holds: all zeros


@dataclass(frozen=True)
class Landed:
    """A slot write that landed: its version and slot, GPU seconds of the write (transfer +
    scatter) and of its host -> device copy alone (None: not timed, an inline write), the
    bytes it copied and the seconds since it was issued. ``error``: the write failed instead;
    its version lost the slot (``SlotStore.poll``)."""

    version: AdapterVersion
    slot: int
    gpu_s: float | None
    copy_s: float | None
    copy_bytes: int
    h2d_s: float
    error: BaseException | None = None


@dataclass
class _Slot:
    owner: AdapterVersion | None = None
    ready: bool = False  # its owner's write landed
    # rows joined the step that issues the write (that step waits for it on the device, later
    # steps run behind it): they may read the slot before ``ready``
    joined: bool = False
    refs: int = 0  # running requests reading the slot (it changes owner only at 0)
    job: SlotJob | None = None  # its owner's write in flight
    last: SlotJob | None = None  # the last write begun into it (a failure voids ``contents``)
    # what the regions outside the last write's layout hold: zeros when ``contents`` is that
    # layout (a LayoutKey) or _CLEAR; None: unknown. ``generation``: the model's per-module
    # writes then (a write nobody recorded voids it)
    contents: Any = None
    generation: int = 0
    dora: bool = False  # its DoRA scales may not be ones


@dataclass
class SlotStore:
    """The slot table, its references, writes and landing (see the module docstring).

    ``writer``: how writes are issued (default: one that refuses, for registry-only tests);
    ``ranks``: the runner's ``SlotRanks`` (this store is its only writer); ``pool``: the host
    pool whose regions writes copy from (held until issued); ``generation``: the model's
    per-module writes (``SlotBuffers.generation``); ``eviction``: this tier's policy
    (``tier_policy``); ``num_expert``: the expert-capable slots (None: all). The registry binds ``pinned`` (whether an operator pin holds a version's
    slot), ``on_taken(old, new)`` and ``on_use(v, now)`` (a use of a version: the host tier's
    policy).
    """

    num_slots: int
    num_full: int = 0
    num_expert: int | None = None
    writer: SlotWriter = field(default_factory=lambda: InlineWriter(None))
    ranks: SlotRanks | None = None
    pool: HostPool | None = None
    generation: Callable[[], int] = lambda: 0
    pinned: Callable[[AdapterVersion], bool] = lambda v: False
    on_taken: Callable[[AdapterVersion, AdapterVersion], None] = lambda old, new: None
    on_use: Callable[[AdapterVersion, float], None] = lambda v, now: None
    eviction: EvictionPolicy = field(default_factory=tier_policy)

    def __post_init__(self) -> None:
        self._slots = [_Slot() for _ in range(self.num_slots)]
        self._of: dict[AdapterVersion, int] = {}  # owner -> its slot (identity: eq=False)
        self._jobs: list[SlotJob] = []  # begun, not landed or failed yet

    # -- ownership --------------------------------------------------------------------------

    def slot_of(self, v: AdapterVersion) -> int | None:
        """The slot ``v`` holds (its write may still be in flight), if any."""
        return self._of.get(v)

    def owner(self, slot: int) -> AdapterVersion | None:
        """The version ``slot`` is assigned to, if any."""
        return self._slots[slot].owner

    def is_ready(self, v: AdapterVersion) -> bool:
        """``v`` holds a slot whose write has landed."""
        slot = self._of.get(v)
        return slot is not None and self._slots[slot].ready

    @property
    def resident(self) -> list[AdapterVersion]:
        """Versions holding a slot (their write may still be pending), in slot order."""
        return [s.owner for s in self._slots if s.owner is not None]

    @property
    def expert_slots(self) -> int:
        """Slots ``0 .. expert_slots - 1`` hold expert LoRA storage."""
        return self.num_slots if self.num_expert is None else self.num_expert

    def _needs(self, v: AdapterVersion | None) -> tuple[bool, bool]:
        """Whether ``v`` needs a full-table slot, an expert-capable one."""
        full = self.num_full > 0 and v is not None and _has_full(v)  # (none without such slots)
        experts = v is not None and self.num_expert is not None and _has_experts(v)
        return full, experts

    def usable(self, v: AdapterVersion | None) -> range:
        """The slots ``v`` may take, from slot 0 (the full-table slots and the expert-capable
        ones are the first of the store). Two versions with the same range get the same answer
        from a non-forced ``assign`` while no slot changes hands."""
        full, experts = self._needs(v)
        limit = self.num_full if full else self.num_slots
        return range(min(limit, self.expert_slots) if experts else limit)

    def _waste(self, i: int, full: bool, experts: bool) -> int:
        """Capacities of slot ``i`` (full tables, experts) an adapter that needs ``full`` /
        ``experts`` would hold unused."""
        return (not full and i < self.num_full) + (not experts and i < self.expert_slots)

    def assign(self, v: AdapterVersion, *, force: bool = False) -> int | None:
        """The slot ``v`` now holds (a write must follow), or None if no slot can be taken
        now. SlotFullError if every slot ``v`` may take is pinned."""
        assert v.state is AdapterState.CPU
        slot = self._of.get(v)
        if slot is not None:
            return slot
        full, experts = self._needs(v)
        usable = self.usable(v)
        if not usable:
            raise SlotFullError(
                f"adapter {v.name!r} has LoRA on the experts but the engine has no "
                "expert-capable slots (max_expert_loras is 0)"
            )
        free = [i for i in usable if self._slots[i].owner is None]
        old = None
        if free:
            # NOTE: an adapter takes a slot whose full tables / experts it needs not last
            slot = min(free, key=lambda i: (self._waste(i, full, experts), i))
        else:
            idle = [o for o in self.idle_owners(force) if self._of[o] in usable]
            if not idle:
                if all((o := self._slots[i].owner) is not None and self.pinned(o) for i in usable):
                    what = f"{self.num_slots}"
                    if full or experts:
                        kind = "full-table" if full else "expert-capable"
                        what = f"{len(usable)} {kind}"
                    raise SlotFullError(
                        f"all {what} GPU slots are pinned; adapter {v.name!r} cannot be served"
                    )
                return None
            old = self.eviction.victim(idle, now=time.monotonic())
            slot = self._of.pop(old)
        s = self._slots[slot]
        s.owner, s.ready, s.joined, s.job = v, False, False, None
        self._of[v] = slot
        self.use(v)
        if old is not None:
            self.on_taken(old, v)
        return slot

    def can_assign(self, v: AdapterVersion | None = None, *, force: bool = False) -> bool:
        """Whether ``assign`` would find a slot now (no side effects); ``v``: for this version
        (an adapter with full tables takes only a full-table slot, one with experts only an
        expert-capable one)."""
        usable = self.usable(v)
        if any(self._slots[i].owner is None for i in usable):
            return True
        return any(self._of[o] in usable for o in self.idle_owners(force))

    def idle_owners(self, force: bool) -> Iterator[AdapterVersion]:
        """Slot owners that may lose their slot now (see the module docstring)."""
        return (
            s.owner
            for s in self._slots
            if s.owner is not None
            and s.refs == 0
            and s.ready
            and not self.pinned(s.owner)
            and (force or s.owner.users == 0)
        )

    def use(self, v: AdapterVersion) -> None:
        """A use of ``v`` now: its ``last_used`` (the LRU order), this tier's policy (its
        bytes, and what its slot write cost when one landed, ``timings["h2d"]``; else the
        policy estimates it) and ``on_use``."""
        now = v.last_used = time.monotonic()
        self.eviction.touch(v, now=now, size=v.nbytes, cost=v.timings.get("h2d"))
        self.on_use(v, now)

    def free(self, v: AdapterVersion) -> None:
        """``v`` (forgotten) gives its slot back and leaves the policy (which would otherwise
        keep it alive); a write of it still in flight lands unseen (the next owner's write is
        issued behind it on the same stream)."""
        self.eviction.forget(v)
        slot = self._of.get(v)
        if slot is not None:
            s = self._slots[slot]
            assert s.refs == 0, f"slot {slot} freed while read"
            del self._of[v]
            s.owner, s.ready, s.joined, s.job = None, False, False, None

    # -- references of running requests -------------------------------------------------------

    def acquire(self, v: AdapterVersion) -> int:
        """A request starts running on ``v``'s slot (written, or written in the step the
        request joins); the slot keeps its owner while such references remain. Returns it."""
        slot = self._of[v]
        self._slots[slot].refs += 1
        self.use(v)
        return slot

    def release(self, v: AdapterVersion) -> None:
        """A running request on ``v``'s slot finished or was preempted."""
        s = self._slots[self._of[v]]
        assert s.refs > 0, f"slot refcount of {v.key} would go negative"
        s.refs -= 1

    def refs(self, v: AdapterVersion) -> int:
        """Running requests reading ``v``'s slot (0 without one)."""
        slot = self._of.get(v)
        return self._slots[slot].refs if slot is not None else 0

    # -- writes -----------------------------------------------------------------------------------

    def begin(self, versions: list[AdapterVersion], readers: set[AdapterVersion]) -> list[SlotJob]:
        """Loop (``StepExecutor.prepare``): the jobs of a step's slot writes (``versions``, each
        holding its slot, loaded); ``readers``: versions with rows in that step (they join the
        write). Takes the decisions, holds the regions and sets the slots' ranks."""
        jobs = []
        gen = self.generation() if versions else 0
        for v in versions:
            adapter = v.adapter
            slot = self._of.get(v)
            assert adapter is not None and slot is not None, f"{v.key}: no slot or no adapter"
            s = self._slots[slot]
            image = getattr(adapter, "image", None)
            layout = image.layout if image is not None else None
            known = s.contents is not None and s.generation == gen
            zero_rest = not (known and (s.contents == _CLEAR or s.contents == layout))
            dora = adapter.dora is not None
            joined = v in readers
            nbytes = image.nbytes if image is not None else adapter.nbytes
            job = SlotJob(
                v, slot, adapter, v.region if self.pool is not None else None, zero_rest,
                s.dora, joined, nbytes,
            )  # fmt: skip
            if job.region is not None:
                self.pool.hold(job.region)  # type: ignore[union-attr]
            s.contents, s.generation, s.dora = layout, gen, dora
            s.job = s.last = job
            s.joined = joined
            if self.ranks is not None:
                self.ranks.set(slot, v.rank, dora)
            self._jobs.append(job)
            jobs.append(job)
        return jobs

    def readable(self, v: AdapterVersion, slot: int) -> bool:
        """``StepExecutor.prepare``'s invariant: a row of ``v`` may read ``slot`` (``v`` owns it
        and its write landed, or the row joined the step that writes it)."""
        s = self._slots[slot]
        return s.owner is v and (s.ready or s.joined)

    def issue(
        self, jobs: list[SlotJob], *, after: Any, busy: set[int], read: set[int]
    ) -> list[Any]:
        """Step thread: every job to the writer. A write waits for the step in flight (its
        event ``after``) only when that step reads the slot (``busy``: e.g. a request aborted
        after it was planned, whose slot went back); otherwise it overlaps it. Slots in
        ``read`` (rows of this step joined their write) are written unpaced; returns the
        events those rows wait for on the device (none for an inline write: it is queued
        before them on the same stream). Uses the jobs' snapshots, never the versions' live
        state: the loop may drop a version meanwhile (its slot is then written for nothing,
        and the next owner's write, issued later on the same stream, replaces it)."""
        joined = []
        for job in jobs:
            job.h2d_start = time.perf_counter()
            self.writer.submit(job, after if job.slot in busy else None, paced=job.slot not in read)
            if job.slot in read:
                joined.append(job)
        events = []
        for job in joined:
            if not job.issued.wait(timeout=30.0):
                raise RuntimeError(f"the slot write of {job.version.name!r} was not issued in 30 s")
            if job.error is not None:
                raise RuntimeError(f"the slot write of {job.version.name!r} failed (see the log)")
            if job.events is not None:
                events.append(job.events[2])
        return events

    def collected(self, jobs: list[SlotJob]) -> None:
        """Step thread: the step that issued ``jobs`` was collected: its inline writes are
        done (they land when the loop polls, as a step's results are applied)."""
        for job in jobs:
            if job.events is None:
                job.done = True

    def poll(self) -> list[Landed]:
        """Loop: the writes that landed since the last poll (their slots ready), and those that
        failed (``Landed.error``: their versions lost the slot; the caller fails the requests
        waiting on them)."""
        if not self._jobs:
            return []
        out = []
        keep = []
        for job in self._jobs:
            if job.error is not None:
                failed = self._failed(job)
                if failed is None:
                    keep.append(job)  # (rows that joined it still hold the slot: their step
                    continue  # fails; the slot goes once they are released)
                if failed:
                    out.append(Landed(job.version, job.slot, None, None, 0, 0.0, job.error))
                continue
            if not job.landed():
                keep.append(job)
                continue
            s = self._slots[job.slot]
            if s.job is not job:
                continue  # its version lost the slot meanwhile (dropped): landed unseen
            s.ready, s.job = True, None
            gpu_s = copy_s = None
            if job.events is not None:
                start, copied, done = job.events
                gpu_s = start.elapsed_time(done) / 1e3  # transfer + on-device scatter
                copy_s = start.elapsed_time(copied) / 1e3  # the host -> device transfer alone
            h2d_s = time.perf_counter() - (job.h2d_start or time.perf_counter())
            out.append(Landed(job.version, job.slot, gpu_s, copy_s, job.nbytes, h2d_s))
        self._jobs = keep
        return out

    def _failed(self, job: SlotJob) -> bool | None:
        """A write that failed (logged by the writer): what its slot holds is unknown now, and
        its version (if it still owns the slot) gives the slot back. True: it did; False: the
        version had lost the slot already; None: not yet, running requests read the slot."""
        s = self._slots[job.slot]
        if s.last is job:
            s.contents, s.dora = None, True
        if s.job is not job:
            return False
        if s.refs:
            return None
        del self._of[job.version]
        s.owner, s.ready, s.joined, s.job = None, False, False, None
        return True

    def pending(self) -> bool:
        """A slot was handed out and its write has not landed (or not been issued) yet."""
        return any(
            s.owner is not None and not s.ready and s.owner.adapter is not None for s in self._slots
        )

    def landing_besides(self, versions: list[AdapterVersion]) -> bool:
        """Some slot's write other than those of ``versions`` has not landed yet (the
        scheduler joins no request to a step while one is landing)."""
        return any(
            s.owner is not None and not s.ready and s.owner not in versions for s in self._slots
        )

    def close(self) -> None:
        """Stop the writer (blocking)."""
        self.writer.close()
