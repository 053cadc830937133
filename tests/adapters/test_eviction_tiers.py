"""The eviction policies wired into the adapter tiers (issue 41): the config's names, the
default LRU reading ``last_used``, a cost-aware policy picking another victim than LRU in the
GPU slots and the CPU tier on one scripted use order, and no policy keeping a version that
left (unregistered, superseded, unloaded)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex.engine.adapters.eviction import LRU, POLICIES, tier_policy
from loraplex.engine.adapters.registry import AdapterRegistry, AdapterState
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.adapters.version import AdapterVersion
from loraplex.engine.config import ADAPTER_EVICTIONS, EngineConfig
from tests.helpers.adapters import FakeLoader, loaded, make_manager, register_version
from tests.helpers.slots import FakeWriter, land


def test_config_names_are_the_policies_and_lru_is_the_default() -> None:
    assert tuple(POLICIES) == ADAPTER_EVICTIONS
    assert EngineConfig().adapter_eviction == "lru"
    for name in POLICIES:
        assert EngineConfig(adapter_eviction=name).adapter_eviction == name
        assert tier_policy(name).name == name


def test_unknown_policy_is_refused_naming_the_field_and_flag() -> None:
    with pytest.raises(ValueError, match=r"adapter_eviction \(--adapter-eviction\).*gdf.*'arc'"):
        EngineConfig(adapter_eviction="arc")
    with pytest.raises(ValueError, match="'arc'"):
        tier_policy("arc")


def test_the_tiers_lru_orders_by_last_used_and_keeps_nothing() -> None:
    lru = tier_policy("lru")
    assert isinstance(lru, LRU)
    a, b, c = (AdapterVersion(n, "", n, 1) for n in "abc")
    for v, t in ((a, 3.0), (b, 1.0), (c, 2.0)):
        lru.touch(v, now=100.0, size=1, cost=None)  # the touch's time is not what counts
        v.last_used = t
    assert len(lru) == 0
    assert lru.victim([a, b, c], now=0.0) is b
    c.last_used = 0.5  # set later (as tests and the tiers do): the order follows it
    assert lru.victim([a, c], now=0.0) is c


def _v(name: str) -> AdapterVersion:
    v = AdapterVersion(name, f"/srv/{name}", "d" + name, 1)
    v.state, v.nbytes = AdapterState.CPU, 27_000_000
    v.adapter = SimpleNamespace(rank=4, nbytes=1000, dora=None, image=None, full={})
    v.timings = {"h2d": 0.004}  # the same measured slot write for each
    return v


@pytest.mark.parametrize(("name", "evicted"), [("lru", "hot"), ("gdf", "once"), ("lfu", "once")])
def test_gpu_slots_victim_by_policy(name: str, evicted: str) -> None:
    store = SlotStore(2, writer=FakeWriter(), eviction=tier_policy(name))
    hot, once, new = _v("hot"), _v("once"), _v("new")
    assert [store.assign(hot), store.assign(once)] == [0, 1]
    land(store, hot)
    land(store, once)
    for _ in range(5):  # hot runs five requests, then once runs one (the most recent)
        store.acquire(hot)
        store.release(hot)
    store.acquire(once)
    store.release(once)
    assert hot.last_used < once.last_used
    slot = store.assign(new)
    assert store.owner(slot) is new
    assert {v.name for v in store.resident} == {"hot", "once", "new"} - {evicted}


@pytest.mark.parametrize(("name", "evicted"), [("lru", "hot"), ("gdf", "once"), ("gdsf", "once")])
async def test_cpu_tier_victim_by_policy(name: str, evicted: str) -> None:
    loader = FakeLoader()
    m = make_manager(max_loras=1, max_cpu_loras=2, loader=loader, eviction=tier_policy(name))
    hot, once = loaded(m, "hot"), loaded(m, "once")
    for v in (hot, once):
        v.nbytes, v.timings = 27_000_000, {"fetch": 0.05, "stage": 0.1}
    for _ in range(5):
        m.add_user(hot)
        m.drop_user(hot)
    m.add_user(once)
    m.drop_user(once)
    third = register_version(m, "third")
    m.add_user(third)
    await loader.finish(third)
    states = {v.name: v.state for v in (hot, once, third)}
    assert states.pop(evicted) is AdapterState.REGISTERED
    assert set(states.values()) == {AdapterState.CPU}
    assert m.stats["cpu_evictions"] == 1


@pytest.mark.parametrize("name", sorted(POLICIES))
async def test_policies_let_go_of_versions_that_leave(name: str) -> None:
    loader = FakeLoader()
    m = AdapterRegistry(
        max_loras=1, max_cpu_loras=2, loader=loader, eviction=tier_policy(name),
        slots=SlotStore(1, writer=FakeWriter(), eviction=tier_policy(name)),
    )  # fmt: skip
    v = register_version(m, "a")
    m.add_user(v)
    await loader.finish(v)
    assert m.slots.assign(v) == 0
    land(m.slots, v)
    m.slots.acquire(v)
    m.slots.release(v)
    m.drop_user(v)
    # superseded: a new version of the name; the old one is collected (it is idle)
    newer = register_version(m, "a", digest="sha-a2")
    m.add_user(newer)
    await loader.finish(newer)
    m.drop_user(newer)
    failed = register_version(m, "b")  # a load that fails: unloaded, then unregistered
    m.add_user(failed)
    await loader.finish(failed, RuntimeError("boom"))
    m.drop_user(failed)
    m.unregister("a")
    m.unregister("b")
    assert m.versions() == []
    # (a policy holds its keys strongly: one that missed a forget would keep them alive)
    assert len(m.eviction) == 0 and len(m.slots.eviction) == 0
