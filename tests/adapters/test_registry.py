"""AdapterRegistry on its own: a fake loader, no model, no engine.

Covers single-flight loads, user and slot reference counts, failed / cancelled loads and the
registry; the CPU tier and GPU slots: test_registry_residency.py (same fakes).
"""

from __future__ import annotations

import asyncio

import pytest

from loraplex.engine.adapters.registry import AdapterState
from loraplex.engine.errors import AdapterNotFoundError
from tests.helpers.adapters import (
    FakeLoader,
    in_slot,
    loaded,
    make_manager,
    register_version,
    settle,
)

# -- single flight ------------------------------------------------------------------------------


async def test_one_load_per_version_shared_by_its_users():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register_version(m, "sql")
    assert m.add_user(v) == "cold"
    assert m.add_user(v) == "cold"
    m.ensure_loaded(v)
    await asyncio.sleep(0)
    assert loader.calls == [v] and v.state is AdapterState.LOADING
    assert m.stats["loads"] == 1 and m.stats["misses"] == 2
    await loader.finish(v)
    assert v.state is AdapterState.CPU and v.adapter is not None and v.load_task is None
    assert v.users == 2
    m.ensure_loaded(v)  # loaded: nothing to do
    assert m.add_user(v) == "cpu"  # in the CPU tier, no slot yet
    assert loader.calls == [v] and m.stats["loads"] == 1 and m.stats["cpu_hits"] == 1


async def test_each_version_loads_on_its_own():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    old = register_version(m, "sql", "d1")
    m.add_user(old)
    new = register_version(m, "sql", "d2")  # new content under the same name: a new version
    assert new is not old and m.get("sql") is new
    m.add_user(new)
    await asyncio.sleep(0)
    assert loader.calls == [old, new] and m.stats["loads"] == 2
    await loader.finish(new)
    assert new.state is AdapterState.CPU and old.state is AdapterState.LOADING
    await loader.finish(old)
    assert old.state is AdapterState.CPU


async def test_on_change_is_called_when_a_load_ends_either_way():
    loader, changes = FakeLoader(), []
    m = make_manager(loader=loader, on_change=lambda: changes.append(1))
    a, b = register_version(m, "a"), register_version(m, "b")
    m.add_user(a)
    m.add_user(b)
    await loader.finish(a)
    assert len(changes) == 1
    await loader.finish(b, RuntimeError("boom"))
    assert len(changes) == 2


# -- references ---------------------------------------------------------------------------------


async def test_user_count_back_to_zero_after_requests_end():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register_version(m, "sql")
    m.add_user(v)
    m.add_user(v)
    await loader.finish(v)
    m.drop_user(v)
    m.drop_user(v)
    assert v.users == 0 and v.state is AdapterState.CPU  # stays cached for the next request
    with pytest.raises(AssertionError):
        m.drop_user(v)


def test_slot_refs_back_to_zero_and_never_negative():
    m = make_manager()
    v = in_slot(m, "sql")
    m.slots.acquire(v)
    m.slots.acquire(v)
    assert m.slots.refs(v) == 2 and v.last_used > 0.0  # a reader touches it (LRU)
    m.slots.release(v)
    m.slots.release(v)
    assert m.slots.refs(v) == 0
    with pytest.raises(AssertionError):
        m.slots.release(v)


def test_acquire_needs_a_slot():
    m = make_manager()
    v, w = loaded(m, "sql"), loaded(m, "poem")
    with pytest.raises(KeyError):
        m.slots.acquire(v)  # no slot
    slot = m.slots.assign(v)
    with pytest.raises(KeyError):
        m.slots.acquire(w)  # the slot belongs to v
    assert m.slots.refs(v) == m.slots.refs(w) == 0
    assert m.slots.acquire(v) == slot  # before its write landed: a request joining its step
    assert m.slots.refs(v) == 1 and not m.slots.is_ready(v)


async def test_last_user_leaving_cancels_the_load():
    loader, unloaded = FakeLoader(), []
    m = make_manager(loader=loader, on_unload=unloaded.append)
    v = register_version(m, "sql")
    m.add_user(v)
    m.add_user(v)
    await asyncio.sleep(0)
    task = v.load_task
    m.drop_user(v)
    assert not task.cancelled() and v.state is AdapterState.LOADING  # one user still waits
    m.drop_user(v)
    await settle(task)
    assert task.cancelled()
    assert v.state is AdapterState.REGISTERED and v.adapter is None and v.load_task is None
    assert unloaded == [v] and v.users == 0 and m.get("sql") is v  # a static name stays
    assert m.stats["loads"] == 1 and m.stats["load_cancels"] == 1  # (no load event for it)
    m.add_user(v)  # a later request loads it again
    await asyncio.sleep(0)
    assert v.state is AdapterState.LOADING and len(loader.calls) == 2
    await loader.finish(v)
    assert v.state is AdapterState.CPU


async def test_last_user_leaving_before_the_load_ran():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register_version(m, "sql")
    m.add_user(v)
    task = v.load_task
    m.drop_user(v)  # e.g. the request aborted before the loop ran the load task once
    await settle(task)
    assert task.cancelled() and loader.calls == []
    assert v.state is AdapterState.REGISTERED and v.load_task is None
    assert m.stats["load_cancels"] == 1
    m.add_user(v)  # a later request loads it again
    assert v.state is AdapterState.LOADING and v.load_task is not None
    await asyncio.sleep(0)
    assert loader.calls == [v]
    await loader.finish(v)
    assert v.state is AdapterState.CPU


async def test_cancelled_dynamic_version_is_forgotten():
    loader, dropped = FakeLoader(), []
    m = make_manager(loader=loader, on_drop=dropped.append)
    v = register_version(m, "made-up", dynamic=True)
    m.add_user(v)
    await asyncio.sleep(0)
    task = v.load_task
    m.drop_user(v)
    await settle(task)
    assert "made-up" not in m.names() and v not in m.versions() and dropped == [v]


# -- failed loads -------------------------------------------------------------------------------


async def test_failed_load_fails_only_that_version():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    bad, good = register_version(m, "bad"), register_version(m, "good")
    m.add_user(bad)
    m.add_user(bad)
    m.add_user(good)
    error = ValueError("corrupt safetensors")
    await loader.finish(bad, error)
    await loader.finish(good)
    assert bad.state is AdapterState.FAILED and bad.error is error and bad.adapter is None
    assert good.state is AdapterState.CPU and good.error is None
    assert m.stats["load_failures"] == 1 and bad.users == 2 and good.users == 1


async def test_reset_failed_allows_a_retry():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register_version(m, "sql")
    m.add_user(v)
    await loader.finish(v, OSError("unreachable"))
    m.drop_user(v)  # its waiter was failed
    assert v.users == 0 and v.state is AdapterState.FAILED
    m.reset_failed(v)
    assert v.state is AdapterState.REGISTERED and m.get("sql") is v
    m.add_user(v)
    await loader.finish(v)
    assert v.state is AdapterState.CPU and v.error is None and len(loader.calls) == 2


async def test_reset_failed_forgets_a_dynamic_version():
    loader = FakeLoader()
    m = make_manager(loader=loader)
    v = register_version(m, "made-up", dynamic=True)
    m.add_user(v)
    await loader.finish(v, OSError("404"))
    m.drop_user(v)
    m.reset_failed(v)
    with pytest.raises(AdapterNotFoundError):
        m.get("made-up")
    assert v not in m.versions()


# -- registry -----------------------------------------------------------------------------------


def test_same_content_keeps_the_current_version():
    dropped = []
    m = make_manager(on_drop=dropped.append)
    cur = register_version(m, "sql", "d1")
    dup = m.new_version("sql", "file:///elsewhere")
    dup.digest = "d1"
    assert m.register(dup) is cur and dropped == [dup] and m.versions() == [cur]


def test_superseded_version_lives_while_used_then_frees_its_slot():
    dropped = []
    m = make_manager(max_loras=1, max_cpu_loras=2, on_drop=dropped.append)
    old = in_slot(m, "sql", digest="d1")
    old.users = 1
    m.slots.acquire(old)
    new = register_version(m, "sql", "d2")
    assert m.versions() == [old, new] and m.slots.owner(0) is old
    m.slots.release(old)
    m.drop_user(old)  # its last request ends: forgotten, slot free
    assert m.versions() == [new] and dropped == [old]
    assert m.slots.owner(0) is None and m.slots.slot_of(old) is None and old.adapter is None


def test_unregister_and_forget():
    m = make_manager()
    v = register_version(m, "sql")
    m.unregister("sql")
    assert m.names() == [] and v not in m.versions()
    with pytest.raises(AdapterNotFoundError):
        m.unregister("sql")
    w = register_version(m, "poem")
    stale = m.new_version("poem", "x")  # never registered: forget leaves the current one
    m.forget(stale)
    assert m.get("poem") is w
    m.forget(w)
    assert m.names() == []
