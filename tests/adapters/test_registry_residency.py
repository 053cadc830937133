"""AdapterRegistry's residency on its own (the fakes of tests/helpers/adapters.py): the CPU tier (LRU
over idle versions) and GPU slot assignment, pins and eviction."""

from __future__ import annotations

import asyncio
import random

import pytest

from loraplex.engine.adapters.registry import AdapterState, SlotFullError
from tests.helpers.adapters import FakeLoader, in_slot, loaded, make_manager, register_version

# -- CPU tier -----------------------------------------------------------------------------------


async def test_cpu_tier_evicts_the_least_recently_used_idle_version():
    loader, unloaded = FakeLoader(), []
    m = make_manager(max_loras=1, max_cpu_loras=2, loader=loader, on_unload=unloaded.append)
    old, newer = loaded(m, "old", last_used=1.0), loaded(m, "newer", last_used=2.0)
    v = register_version(m, "third")
    m.add_user(v)
    await loader.finish(v)
    assert v.state is AdapterState.CPU
    assert old.state is AdapterState.REGISTERED and old.adapter is None and unloaded == [old]
    assert newer.state is AdapterState.CPU and m.stats["cpu_evictions"] == 1


async def test_cpu_tier_keeps_versions_in_use_or_in_a_slot():
    loader = FakeLoader()
    m = make_manager(max_loras=1, max_cpu_loras=2, loader=loader)
    slotted = in_slot(m, "slotted", last_used=1.0)
    used = loaded(m, "used", last_used=2.0)
    used.users = 1
    v = register_version(m, "third")
    m.add_user(v)
    await loader.finish(v)
    # nothing idle to evict: the tier runs over its size rather than drop what is needed
    assert [x.state for x in (slotted, used, v)] == [AdapterState.CPU] * 3
    assert m.stats["cpu_evictions"] == 0
    used.users = 0
    assert m.make_room() and used.state is AdapterState.REGISTERED
    assert not m.make_room()  # the slotted one is held by its slot, the new one by its user


def test_make_room_evicts_one_lru_idle_version():
    m = make_manager(max_loras=1, max_cpu_loras=4)
    a, b, c = (loaded(m, n, last_used=t) for n, t in (("a", 3.0), ("b", 1.0), ("c", 2.0)))
    assert m.make_room()
    assert [x.state for x in (a, b, c)] == [
        AdapterState.CPU,
        AdapterState.REGISTERED,
        AdapterState.CPU,
    ]
    assert m.stats["cpu_evictions"] == 1


def test_operator_pin_keeps_the_slot_and_so_the_cpu_copy():
    m = make_manager(max_loras=1, max_cpu_loras=1)
    pinned = in_slot(m, "pinned")
    m.pin("pinned")
    assert not m.make_room() and pinned.state is AdapterState.CPU
    v = loaded(m, "other")
    with pytest.raises(SlotFullError):
        m.slots.assign(v)
    assert m.slots.slot_of(pinned) == 0 and m.slots.owner(0) is pinned


# -- GPU slots ----------------------------------------------------------------------------------


def test_free_slots_are_taken_first_in_order():
    m = make_manager(max_loras=3, max_cpu_loras=3)
    a, b = loaded(m, "a"), loaded(m, "b")
    assert m.slots.can_assign()
    assert m.slots.assign(a) == 0 and m.slots.assign(b) == 1
    assert not m.slots.is_ready(a) and m.slots.assign(a) == 0  # already has one: unchanged
    assert m.slots.resident == [a, b] and m.slots.owner(2) is None
    assert m.stats["gpu_evictions"] == 0


def test_full_slots_evict_the_lru_unreferenced_owner():
    m = make_manager(max_loras=3, max_cpu_loras=4)
    busy = in_slot(m, "busy", last_used=0.5)
    m.slots.acquire(busy)  # a running request reads it: never taken, however old
    busy.last_used = 0.5
    old, recent = in_slot(m, "old", last_used=1.0), in_slot(m, "recent", last_used=2.0)
    v = loaded(m, "new")
    assert m.slots.can_assign()
    assert m.slots.slot_of(old) == 1
    assert m.slots.assign(v) == 1
    assert m.slots.slot_of(old) is None and not m.slots.is_ready(old) and m.slots.owner(1) is v
    assert m.slots.slot_of(v) == 1 and not m.slots.is_ready(v)  # usable once its write lands
    assert m.slots.slot_of(busy) == 0 and m.slots.slot_of(recent) == 2
    assert m.stats["gpu_evictions"] == 1


@pytest.mark.parametrize(
    "why, owner, force, takeable",
    [
        ("idle", dict(), False, True),
        ("read by a running request", dict(refs=1), True, False),
        ("its write has not landed", dict(landed=False), True, False),
        ("operator pin", dict(pinned=True), True, False),
        ("requests wait for it", dict(users=2), False, False),
        ("requests wait for it, a starved request forces", dict(users=2), True, True),
    ],
)
def test_which_owner_may_lose_its_slot(why, owner, force, takeable):
    m = make_manager(max_loras=2, max_cpu_loras=3)
    owner = dict(owner)
    if owner.pop("landed", True):
        o = in_slot(m, "owner")
    else:
        o = loaded(m, "owner")
        assert m.slots.assign(o) == 0
    m.slots.acquire(in_slot(m, "busy"))  # never takeable (and not every slot is pinned)
    for _ in range(owner.pop("refs", 0)):
        m.slots.acquire(o)
    for k, val in owner.items():
        setattr(o, k, val)
    v = loaded(m, "new")
    # the two entry points decide alike (one idle-slot check)
    assert m.slots.can_assign(force=force) is takeable, why
    slot = m.slots.assign(v, force=force)
    assert (slot == 0) is takeable and (m.slots.owner(0) is (v if takeable else o)), why
    assert (m.slots.slot_of(o) is None) is takeable and (m.slots.slot_of(v) == slot)


def test_pin_holds_for_the_current_version_only():
    m = make_manager(max_loras=1, max_cpu_loras=3)
    old = in_slot(m, "sql", digest="d1")
    m.pin("sql")
    old.users = 1  # a request waits for it: only a starved request could take its slot
    other = loaded(m, "other")
    assert not m.slots.can_assign(force=True)  # pinned
    new = loaded(m, "sql", digest="d2")  # the name gets new content
    assert new.pinned and m.get("sql") is new  # the pin belongs to the name
    assert old in m.versions()  # still used: it drains on its slot
    assert not m.slots.can_assign() and m.slots.assign(other) is None  # it has a user
    assert m.slots.can_assign(force=True)  # the old version's pin no longer holds
    assert m.slots.assign(other, force=True) == 0 and m.slots.slot_of(old) is None


def test_all_slots_pinned_raises_slot_full():
    m = make_manager(max_loras=2, max_cpu_loras=3)
    in_slot(m, "a")
    in_slot(m, "b")
    m.pin("a")
    m.pin("b")
    v = loaded(m, "c")
    assert not m.slots.can_assign(force=True)
    with pytest.raises(SlotFullError):
        m.slots.assign(v, force=True)
    assert m.slots.slot_of(v) is None


def test_slot_eviction_drops_the_evicted_cpu_copy_when_over_the_tier():
    m = make_manager(max_loras=1, max_cpu_loras=1)
    old = in_slot(m, "old")
    v = loaded(m, "new")  # the tier holds two now: old stays while it has its slot
    assert m.slots.assign(v) == 0
    assert old.state is AdapterState.REGISTERED and old.adapter is None
    assert v.state is AdapterState.CPU and m.stats["cpu_evictions"] == 1


async def test_room_is_announced_when_a_version_may_be_evicted_or_was_unloaded():
    """``on_room`` (a load waiting for host memory looks again): the last request of a loaded
    version ends, a load ends, a version is unloaded; not while a request still holds it."""
    loader, told = FakeLoader(), []
    m = make_manager(max_loras=1, max_cpu_loras=1, loader=loader, on_room=lambda: told.append(1))
    v = register_version(m, "a")
    m.add_user(v)
    m.add_user(v)
    await loader.finish(v)
    assert v.state is AdapterState.CPU and len(told) == 1  # the load ended
    m.drop_user(v)
    assert len(told) == 1  # one request still uses it: nothing to evict
    m.drop_user(v)
    assert len(told) == 2  # idle now
    assert m.make_room() and v.state is AdapterState.REGISTERED
    assert len(told) == 3  # unloaded: its host memory went back


def _check_indices(m) -> None:
    alive = m.versions()
    current = {id(m.get(n)) for n in m.names()}
    index = m._index
    assert index.num_loading == sum(v.state is AdapterState.LOADING for v in alive)
    assert m.any_loading() == any(v.state is AdapterState.LOADING for v in alive)
    assert set(index.cpu) == {id(v) for v in alive if v.state is AdapterState.CPU}
    assert m.cpu_room() == (len(index.cpu) < m.max_cpu_loras)
    assert set(index.stale) >= {id(v) for v in alive if id(v) not in current}


async def test_the_indices_follow_every_version_through_a_scripted_trace():
    """The registry's indices (CPU tier, loads in flight, versions not current) answer as a
    scan of every version would, after each step of a random trace of registrations,
    supersessions, requests, loads that end or fail, evictions and unregistrations."""
    loader = FakeLoader()
    m = make_manager(max_loras=2, max_cpu_loras=3, loader=loader)
    rng = random.Random(7)
    names = [f"a{i}" for i in range(5)]
    users: list = []
    for step in range(400):
        op = rng.randrange(6)
        name = rng.choice(names)
        if op == 0:
            register_version(m, name, digest=f"d{step}")  # a new version supersedes
        elif op == 1 and name in m.names():
            v = m.get(name)
            m.add_user(v)
            users.append(v)
        elif op == 2 and users:
            m.drop_user(users.pop(rng.randrange(len(users))))
        elif op == 3:
            for _ in range(3):
                await asyncio.sleep(0)  # started loads reach the loader, cancelled ones end
            loading = [v for v in m.versions() if id(v) in loader._gates and v.load_task]
            if loading:
                v = rng.choice(loading)
                await loader.finish(v, None if rng.random() < 0.8 else RuntimeError("bad"))
                m.reset_failed(v)
        elif op == 4:
            m.make_room()
        elif op == 5 and name in m.names() and rng.random() < 0.3:
            m.unregister(name)
        _check_indices(m)
    while users:
        m.drop_user(users.pop())
    _check_indices(m)
