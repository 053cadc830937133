"""SlotStore (adapters/slot_store.py) on its own, with a writer that writes nothing.

Assignment: free slots first (full-table slots last for plain adapters, only those for
adapters with full tables), then the least recently used idle owner; busy, pinned, unwritten
and waited-for owners keep their slot; all pinned is an error. Writes: the decisions a job
carries (the zero-fill of the rest, the DoRA reset), the slot's rank set when it is planned,
landing (inline jobs at their step's collection), host-pool holds, failures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.adapters.version import AdapterState, AdapterVersion
from loraplex.engine.errors import SlotFullError
from loraplex.engine.model.lora.ranks import SlotRanks
from tests.helpers.slots import FakeWriter, land


def _v(
    name: str,
    *,
    full: bool = False,
    rank: int = 4,
    dora: bool = False,
    layout=None,
    experts: bool = False,
):
    v = AdapterVersion(name, f"/srv/{name}", "d" + name, 1)
    v.state, v.full, v.experts = AdapterState.CPU, full, experts
    image = SimpleNamespace(layout=layout, nbytes=100) if layout is not None else None
    v.adapter = SimpleNamespace(
        rank=rank, nbytes=1000, dora={} if dora else None, image=image, full={}
    )
    return v


def _store(num: int, full: int = 0, **kw) -> SlotStore:
    kw.setdefault("writer", FakeWriter())
    store = SlotStore(num, full, **kw)
    store.pinned = lambda v: v.pinned
    return store


def _written(store: SlotStore, v: AdapterVersion, last_used: float) -> None:
    land(store, v)
    v.last_used = last_used


def test_free_slots_then_the_least_recently_used_idle_owner() -> None:
    taken = []
    store = _store(3, 1)
    store.on_taken = lambda old, new: taken.append((old, new))
    a, b, c, d = (_v(n) for n in "abcd")
    # plain adapters take the lowest free slot that is not a full-table one; slot 0 last
    assert [store.assign(x) for x in (a, b, c)] == [1, 2, 0]
    assert store.assign(a) == 1  # holds one already
    assert store.assign(d) is None  # no write landed: no owner may lose its slot
    assert not store.can_assign(d)
    _written(store, a, 3.0)
    _written(store, b, 1.0)
    _written(store, c, 2.0)
    assert store.can_assign(d)
    assert store.assign(d) == 2 and taken == [(b, d)]  # b: the least recently used
    assert store.slot_of(b) is None and not store.is_ready(b)
    assert store.slot_of(d) == 2 and not store.is_ready(d)
    assert store.owner(2) is d and set(store.resident) == {a, c, d}
    store.free(d)
    assert store.slot_of(d) is None and store.owner(2) is None


def test_busy_waited_for_and_pinned_owners_keep_their_slot() -> None:
    store = _store(2)
    a, b, new = _v("a"), _v("b"), _v("new")
    assert [store.assign(a), store.assign(b)] == [0, 1]
    _written(store, a, 1.0)
    _written(store, b, 2.0)
    store.acquire(a)  # a running request reads it
    b.users = 1  # a request waits for it
    assert store.assign(new) is None
    assert not store.can_assign(new) and store.can_assign(new, force=True)
    assert store.assign(new, force=True) == 1  # a starved request may take b, never a
    store.release(a)
    a.pinned = True
    _written(store, new, 5.0)
    new.pinned = True
    with pytest.raises(SlotFullError, match="pinned"):
        store.assign(_v("late"))


def test_full_table_adapters_take_only_full_table_slots() -> None:
    store = _store(3, 1)
    full, full2, plain = _v("full", full=True), _v("full2", full=True), _v("plain")
    assert store.assign(full) == 0
    assert store.assign(full2) is None  # slot 0's write has not landed
    assert not store.can_assign(full2) and store.can_assign(plain)
    _written(store, full, 1.0)
    assert store.assign(full2) == 0
    assert store.assign(plain) == 1


def test_expert_adapters_take_only_expert_capable_slots() -> None:
    """num_expert 2 of 4 slots: adapters with experts take only slots 0 and 1 (evicting among
    them when both are held), attention-only adapters take slots 2 and 3 first, then the
    expert-capable ones; None keeps every slot expert-capable."""
    taken = []
    store = _store(4, num_expert=2)
    store.on_taken = lambda old, new: taken.append((old.name, new.name))
    e1, e2, e3 = (_v(n, experts=True) for n in ("e1", "e2", "e3"))
    p1, p2, p3 = (_v(n) for n in ("p1", "p2", "p3"))
    assert [store.assign(x) for x in (p1, e1, p2, p3)] == [2, 0, 3, 1]
    assert store.assign(e2) is None and not store.can_assign(e2)  # nothing landed yet
    for v, t in ((p1, 1.0), (e1, 4.0), (p2, 2.0), (p3, 3.0)):
        _written(store, v, t)
    # p1 is the least recently used owner overall, but e2 may only evict from slots 0 and 1
    assert store.assign(e2) == 1 and taken == [("p3", "e2")]
    _written(store, e2, 5.0)
    assert store.assign(e3) == 0 and taken[-1] == ("e1", "e3")  # the LRU expert-capable one
    e3.pinned = e2.pinned = True
    _written(store, e3, 6.0)
    with pytest.raises(SlotFullError, match="2 expert-capable"):
        store.assign(e1)
    assert store.can_assign(_v("p4"))  # attention-only adapters still find slots 2 and 3
    every = _store(2)  # num_expert None: today's behaviour, every slot holds experts
    assert [every.assign(_v("x", experts=True)), every.assign(_v("y", experts=True))] == [0, 1]


def test_expert_adapters_find_no_slot_without_expert_capable_ones() -> None:
    """num_expert 0: a typed refusal naming max_expert_loras (the engine refuses such adapters
    at load already), never an index past the slots."""
    store = _store(2, num_expert=0)
    assert store.assign(_v("plain")) == 0
    assert not store.can_assign(_v("e", experts=True))
    with pytest.raises(SlotFullError, match="max_expert_loras"):
        store.assign(_v("e", experts=True))


def test_an_adapter_image_with_expert_modules_needs_an_expert_slot() -> None:
    """A version whose flag is not set yet (a combination, a test's adapter) is known by its
    image's expert entries (model/moe/lora_names.py)."""
    store = _store(3, num_expert=1)
    v = _v("img")
    v.adapter.image = SimpleNamespace(
        layout=None, nbytes=100, entries={(0, "q_proj"): None, (1, "experts.3.down_proj"): None}
    )
    assert store.assign(_v("plain")) == 1
    assert store.assign(v) == 0


def test_refs_count_running_readers_and_free_needs_none() -> None:
    store = _store(1)
    v = _v("a")
    assert store.refs(v) == 0
    with pytest.raises(KeyError):
        store.acquire(v)  # no slot
    assert store.assign(v) == 0
    assert store.acquire(v) == 0 and store.acquire(v) == 0 and store.refs(v) == 2
    with pytest.raises(AssertionError):
        store.free(v)  # read by running requests
    store.release(v)
    store.release(v)
    with pytest.raises(AssertionError):
        store.release(v)
    store.free(v)


def test_a_write_lands_once_its_step_is_collected_and_polled() -> None:
    writer = FakeWriter()
    ranks = SlotRanks(2)
    store = _store(2, writer=writer, ranks=ranks)
    v, w = _v("a", rank=8, dora=True), _v("b")
    store.assign(v)
    store.assign(w)
    assert store.pending() and not store.readable(v, 0)
    jobs = store.begin([v], readers={v})
    assert ranks.ranks[0] == 8 and ranks.dora == {0}  # set when planned
    assert store.readable(v, 0) and jobs[0].joined  # its rows joined the writing step
    assert store.landing_besides([v]) and not store.landing_besides([v, w])
    assert store.issue(jobs, after="ev", busy={1}, read={0}) == []  # inline: no events
    assert writer.jobs == [(jobs[0], None, False)]  # slot 0 not busy: no wait; read: unpaced
    assert store.poll() == [] and not store.is_ready(v)
    store.collected(jobs)
    (landed,) = store.poll()
    assert landed.version is v and landed.slot == 0 and landed.gpu_s is None
    assert landed.copy_bytes == 1000 and store.is_ready(v) and store.poll() == []
    assert store.pending()  # w's write has not been planned yet
    land(store, w)
    assert not store.pending()


def test_a_busy_slot_waits_for_the_step_in_flight() -> None:
    writer = FakeWriter()
    store = _store(1, writer=writer)
    v = _v("a")
    store.assign(v)
    jobs = store.begin([v], set())
    store.issue(jobs, after="ev", busy={0}, read=set())
    assert writer.jobs == [(jobs[0], "ev", True)]


def test_zero_fill_and_dora_reset_are_skipped_only_where_known() -> None:
    gen = [0]
    store = _store(1, generation=lambda: gen[0])
    same = object()  # a layout
    a, b, c, d = (_v(n, layout=same) for n in "abcd")
    e = _v("e", layout=object())

    def write(v):
        for o in store.resident:
            store.free(o)
        store.assign(v)
        (job,) = store.begin([v], set())
        store.issue([job], after=None, busy=set(), read=set())
        store.collected([job])
        store.poll()
        return job

    first = write(a)
    assert first.zero_rest and not first.had_dora  # unknown contents; fresh DoRA scales
    assert not write(b).zero_rest  # the same layout: the rest is zero already
    assert write(e).zero_rest  # another layout
    assert write(c).zero_rest  # ... and back
    gen[0] += 1  # a per-module (or direct) write since: nothing is known
    assert write(d).zero_rest
    dora = _v("dora", layout=same, dora=True)
    assert not write(dora).had_dora
    assert write(a).had_dora and not write(b).had_dora  # reset once after a DoRA adapter
    plain = _v("plain")  # no image: packed per write, its layout unknown
    assert write(plain).zero_rest and write(a).zero_rest


def test_a_failed_write_gives_the_slot_back_and_voids_what_it_holds() -> None:
    """A write that failed in the writer is reported once (``Landed.error``), its version loses
    the slot (once no running request reads it) and the next write into the slot zero-fills
    and resets DoRA."""
    store = _store(1)
    same = object()
    a, b = _v("a", layout=same), _v("b", layout=same)
    store.assign(a)
    store.acquire(a)  # a request that joined the write's step (its step fails)
    (job,) = store.begin([a], {a})
    job.error = RuntimeError("copy failed")
    assert store.poll() == [] and store.slot_of(a) == 0  # still read: not yet
    store.release(a)
    (failed,) = store.poll()
    assert failed.version is a and failed.error is job.error and store.poll() == []
    assert store.slot_of(a) is None and not store.is_ready(a) and not store.pending()
    store.assign(b)
    (next_job,) = store.begin([b], set())
    assert next_job.zero_rest and next_job.had_dora  # unknown after the failure


def test_a_region_is_not_reused_while_a_write_out_of_it_is_queued() -> None:
    pool = HostPool(4096, 1)
    try:
        store = _store(1, pool=pool)
        v = _v("a")
        v.region = pool.acquire()
        assert v.region is not None
        store.assign(v)
        (job,) = store.begin([v], set())
        assert pool.holds(v.region) == 1
        pool.release(v.region)  # its adapter left the CPU tier before the write was issued
        assert pool.acquire() is None  # held: the queued copy still reads it
        pool.unhold(job.region)  # (what a writer does once the copy is issued)
        assert pool.acquire() is not None
    finally:
        pool.close()
