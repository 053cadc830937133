"""SlotTable (adapters/slot_store.py) on its own: free slots first (full-table slots last for
plain adapters, only those for adapters with full tables), then the least recently used idle
owner; busy, pinned, unwritten and waited-for owners keep their slot; all pinned is an error."""

from __future__ import annotations

import pytest

from loraplex.engine.adapters.slot_store import SlotFullError, SlotTable
from loraplex.engine.adapters.version import AdapterState, AdapterVersion


def _v(name: str, *, full: bool = False) -> AdapterVersion:
    v = AdapterVersion(name, f"/srv/{name}", "d" + name, 1)
    v.state, v.full = AdapterState.CPU, full
    return v


def _written(v: AdapterVersion, last_used: float) -> None:
    v.slot_ready, v.last_used = True, last_used


def test_free_slots_then_the_least_recently_used_idle_owner() -> None:
    table = SlotTable(3, 1, pinned=lambda v: v.pinned)
    a, b, c, d = (_v(n) for n in "abcd")
    # plain adapters take the lowest free slot that is not a full-table one; slot 0 last
    assert [table.assign(x)[0] for x in (a, b, c)] == [1, 2, 0]
    assert table.assign(a) == (1, None)  # holds one already
    assert table.assign(d) == (None, None)  # no write completed: no owner may lose its slot
    assert not table.can_assign(d)
    _written(a, 3.0)
    _written(b, 1.0)
    _written(c, 2.0)
    assert table.can_assign(d)
    assert table.assign(d) == (2, b)  # b: the least recently used
    assert b.slot is None and not b.slot_ready and d.slot == 2 and not d.slot_ready
    assert table.owner(2) is d and set(table.resident) == {a, c, d}
    table.free(d)
    assert d.slot is None and table.owner(2) is None


def test_busy_waited_for_and_pinned_owners_keep_their_slot() -> None:
    table = SlotTable(2, 0, pinned=lambda v: v.pinned)
    a, b, new = _v("a"), _v("b"), _v("new")
    assert [table.assign(a)[0], table.assign(b)[0]] == [0, 1]
    _written(a, 1.0)
    _written(b, 2.0)
    a.slot_refs = 1  # a running request reads it
    b.users = 1  # a request waits for it
    assert table.assign(new) == (None, None)
    assert not table.can_assign(new) and table.can_assign(new, force=True)
    assert table.assign(new, force=True) == (1, b)  # a starved request may take b, never a
    a.slot_refs, a.pinned = 0, True
    _written(new, 5.0)
    new.pinned = True
    with pytest.raises(SlotFullError, match="pinned"):
        table.assign(_v("late"))


def test_full_table_adapters_take_only_full_table_slots() -> None:
    table = SlotTable(3, 1, pinned=lambda v: False)
    full, full2, plain = _v("full", full=True), _v("full2", full=True), _v("plain")
    assert table.assign(full)[0] == 0
    assert table.assign(full2) == (None, None)  # slot 0's write has not completed
    assert not table.can_assign(full2) and table.can_assign(plain)
    _written(full, 1.0)
    assert table.assign(full2) == (0, full)
    assert table.assign(plain)[0] == 1
