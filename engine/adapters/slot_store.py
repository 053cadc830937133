"""GPU slots: which adapter version holds each, and which one a version may take.

Slots ``0 .. max_full - 1`` also hold full tables (model/lora/full.py): the only ones an adapter with
modules_to_save tables may take; other adapters take them last. A slot is taken from its owner
only when the owner is idle: no running request reads it (``slot_refs == 0``), its write has
completed, no operator pin holds it, and (unless ``force``: a starved request needs a slot) no
request waits for it; among idle owners the least recently used loses its slot.

``AdapterRegistry`` (registry.py) owns the table and does the bookkeeping around it (statistics,
the CPU tier); the table itself knows only versions and slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from loraplex.engine.adapters.version import AdapterState, AdapterVersion, _has_full
from loraplex.engine.errors import SlotFullError

__all__ = ["SlotTable", "SlotFullError"]


class SlotTable:
    def __init__(
        self, max_loras: int, max_full: int, pinned: Callable[[AdapterVersion], bool]
    ) -> None:
        self.max_loras = max_loras
        self.max_full = max_full
        self._pinned = pinned  # whether an operator pin holds this version's slot
        self._slots: list[AdapterVersion | None] = [None] * max_loras

    def owner(self, slot: int) -> AdapterVersion | None:
        """The version ``slot`` is assigned to, if any."""
        return self._slots[slot]

    @property
    def resident(self) -> list[AdapterVersion]:
        """Versions holding a slot (their write may still be pending)."""
        return [v for v in self._slots if v is not None]

    def free(self, v: AdapterVersion) -> None:
        """``v`` (forgotten) gives its slot back."""
        if v.slot is not None:
            self._slots[v.slot] = None
            v.slot = None

    def _usable(self, v: AdapterVersion | None) -> tuple[bool, range]:
        full = self.max_full > 0 and v is not None and _has_full(v)  # (none without such slots)
        return full, range(self.max_full) if full else range(self.max_loras)

    def assign(
        self, v: AdapterVersion, *, force: bool = False
    ) -> tuple[int | None, AdapterVersion | None]:
        """(the slot ``v`` now holds (a write must follow), the version that lost it); (None,
        None) if no slot can be taken now. SlotFullError if every slot ``v`` may take is
        pinned."""
        assert v.state is AdapterState.CPU
        if v.slot is not None:
            return v.slot, None
        full, usable = self._usable(v)
        free = [i for i in usable if self._slots[i] is None]
        old = None
        if free:
            # NOTE: an adapter without full tables takes a full-table slot last
            slot = free[0] if full else max(free, key=lambda i: (i >= self.max_full, -i))
        else:
            idle = [o for o in self.idle_owners(force) if o.slot in usable]
            if not idle:
                owners = [self._slots[i] for i in usable]
                if all(o is not None and self._pinned(o) for o in owners):
                    what = f"{self.max_full} full-table" if full else f"{self.max_loras}"
                    raise SlotFullError(
                        f"all {what} GPU slots are pinned; adapter {v.name!r} cannot be served"
                    )
                return None, None
            old = min(idle, key=lambda o: o.last_used)
            slot = old.slot
            old.slot, old.slot_ready, old.slot_event, old.slot_joined = None, False, None, False
        assert slot is not None
        self._slots[slot] = v
        v.slot, v.slot_ready, v.slot_joined = slot, False, False
        v.last_used = time.monotonic()
        return slot, old

    def can_assign(self, v: AdapterVersion | None = None, *, force: bool = False) -> bool:
        """Whether ``assign`` would find a slot now (no side effects); ``v``: for this version
        (an adapter with full tables takes only a full-table slot)."""
        _, usable = self._usable(v)
        if any(self._slots[i] is None for i in usable):
            return True
        return any(o.slot in usable for o in self.idle_owners(force))

    def idle_owners(self, force: bool) -> Iterator[AdapterVersion]:
        """Slot owners that may lose their slot now (see the module docstring)."""
        return (
            o
            for o in self._slots
            if o is not None
            and o.slot_refs == 0
            and o.slot_ready
            and not self._pinned(o)
            and (force or o.users == 0)
        )

    def check(self, v: AdapterVersion) -> bool:
        """``v`` holds the slot it names (a running request's reference is taken on it)."""
        return v.slot is not None and self._slots[v.slot] is v
