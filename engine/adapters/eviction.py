"""Which idle adapter a cache tier gives up: eviction policies chosen by name.

Both adapter tiers (the GPU slots, slot_store.py, and the host tier, registry.py) hold a fixed
number of entries and, when full, must give one up. The tier decides which entries *may* go
(idle, not pinned, write landed); the policy decides which of those *does*. One policy instance
per tier; its state is keyed by the key the tier gives (the ``AdapterVersion`` object, or its
digest), never by ``id()`` (an id is reused once its object dies).

The tier calls:

- ``touch(key, now=, size=, cost=)`` on every use of an entry it holds (a request's hit, a load
  or slot write that put it there). ``size``: the entry's bytes; ``cost``: what missing it
  costs, in seconds, as measured (the load's stage times for the host tier, the slot write for
  the GPU tier), or None (the policy then estimates it from ``size``).
- ``victim(candidates, now=)`` when full: the key to evict among ``candidates`` (never empty).
  It commits: the policy records the eviction and drops the key's state (the caller must then
  evict it; to pick n victims, call it n times, removing each from the candidates).
- ``forget(key)`` when an entry leaves for another reason (unloaded, superseded, dropped), so
  the policy holds no reference to it. Unknown keys are ignored.

Policies (``POLICIES``; ``make_policy(name)``):

- ``lru``: least recently touched first: ties go to the first candidate, a key never touched
  goes before any touched one. The engine's tiers build theirs with ``tier_policy``: it orders
  by the version's own ``last_used`` (the one record of recency, which the tiers set on every
  use), so the default is the tiers' ``min`` / stable sort over ``last_used`` by construction.
- ``lfu``: LFU with dynamic ageing (LFU-DA). Priority = L + uses; the lowest goes; L (the clock)
  rises to each victim's priority. Plain LFU keeps a formerly popular entry forever; with the
  clock, new entries enter at the current L, so an old count is worth less the more evictions
  happened since, and an entry that stops being used falls out once L passes it.
- ``gdsf``: GreedyDual-Size-Frequency. Priority = L + uses * cost / size: keeps what is used
  often and is expensive to bring back per byte held; evicts the cheap, large and rare first.
  Right where a tier's capacity is bytes.
- ``gdf``: GreedyDual-Frequency, GDSF without the size term: priority = L + uses * cost. Where a
  tier's capacity is a count of entries (a slot holds one adapter of any size, the host tier
  holds ``max_cpu_loras``), a large adapter takes no more room than a small one, so dividing by
  size would evict the adapters that are dearest to reload.

Ties in the greedy-dual policies go to the least recently touched, then the first candidate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

__all__ = [
    "POLICIES",
    "EvictionPolicy",
    "GDF",
    "GDSF",
    "LFUDA",
    "LRU",
    "make_policy",
    "tier_policy",
]

# seconds per byte assumed for an unmeasured cost until some entry's cost is measured
# (~1 GB/s: the order of one pass of sha256 over the bytes; only ratios between entries matter)
_NOMINAL_S_PER_BYTE = 1e-9


class EvictionPolicy(Protocol):
    """What a cache tier calls (see the module docstring)."""

    name: str

    def touch(self, key: Hashable, *, now: float, size: int, cost: float | None) -> None: ...

    def victim(self, candidates: Sequence[Hashable], *, now: float) -> Hashable: ...

    def forget(self, key: Hashable) -> None: ...


def _check(candidates: Sequence[Hashable]) -> None:
    if not candidates:
        raise ValueError("victim() needs at least one candidate")


class LRU:
    """Least recently touched first. ``recency``: where the caller keeps each key's last use
    (``tier_policy``: the version's ``last_used``); the policy then orders by it and holds no
    state of its own (touch and forget do nothing)."""

    name = "lru"

    def __init__(self, recency: Callable[[Any], float] | None = None) -> None:
        self._last: dict[Hashable, float] = {}
        self._recency = recency

    def touch(self, key: Hashable, *, now: float, size: int = 0, cost: float | None = None) -> None:
        if self._recency is None:
            self._last[key] = now

    def victim(self, candidates: Sequence[Hashable], *, now: float) -> Hashable:
        _check(candidates)
        last = self._recency or (lambda k: self._last.get(k, -math.inf))
        # NOTE: min keeps the first of equal keys, as the tiers' min / stable sort did
        key = min(candidates, key=last)
        self._last.pop(key, None)
        return key

    def forget(self, key: Hashable) -> None:
        self._last.pop(key, None)

    def __len__(self) -> int:
        return len(self._last)


@dataclass
class _Entry:
    uses: int = 0
    priority: float = 0.0
    last: float = -math.inf
    size: int = 0
    cost: float | None = None  # measured seconds (None: estimated from size)


class _GreedyDual:
    """Priority = L + value(entry), recomputed on each touch; the lowest goes and L rises to it.
    Subclasses define ``value``."""

    name = ""

    def __init__(self) -> None:
        self._entries: dict[Hashable, _Entry] = {}
        self.clock = 0.0  # L: never falls
        # measured cost and bytes of the entries that have a measured cost: the rate that
        # prices an unmeasured one (so measured and estimated costs share one unit)
        self._cost_s = 0.0
        self._cost_bytes = 0

    def value(self, e: _Entry) -> float:
        raise NotImplementedError

    def cost_of(self, e: _Entry) -> float:
        """Seconds to bring ``e`` back: measured, else its bytes at the measured rate."""
        if e.cost is not None:
            return e.cost
        rate = self._cost_s / self._cost_bytes if self._cost_bytes > 0 else _NOMINAL_S_PER_BYTE
        return e.size * rate

    def _measured(self, e: _Entry, sign: int) -> None:
        if e.cost is not None:
            self._cost_s += sign * e.cost
            self._cost_bytes += sign * e.size

    def touch(self, key: Hashable, *, now: float, size: int, cost: float | None) -> None:
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = _Entry()
        self._measured(e, -1)
        e.uses += 1
        e.last = now
        e.size = max(0, int(size))
        if cost is not None:
            e.cost = max(0.0, float(cost))
        self._measured(e, +1)
        e.priority = self.clock + self.value(e)

    def priority(self, key: Hashable) -> float:
        """The key's priority now (a key never touched: the clock)."""
        e = self._entries.get(key)
        return e.priority if e is not None else self.clock

    def victim(self, candidates: Sequence[Hashable], *, now: float) -> Hashable:
        _check(candidates)
        missing = _Entry(priority=self.clock)

        def order(i: int) -> tuple[float, float, int]:
            e = self._entries.get(candidates[i], missing)
            return (e.priority, e.last, i)

        key = candidates[min(range(len(candidates)), key=order)]
        # NOTE: max: a candidate set can skip entries (busy ones) whose priority is below
        # the clock already; L must not fall back to them
        self.clock = max(self.clock, self.priority(key))
        self.forget(key)
        return key

    def forget(self, key: Hashable) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._measured(e, -1)

    def __len__(self) -> int:
        return len(self._entries)


class LFUDA(_GreedyDual):
    """LFU with dynamic ageing: priority = L + uses."""

    name = "lfu"

    def value(self, e: _Entry) -> float:
        return float(e.uses)


class GDSF(_GreedyDual):
    """GreedyDual-Size-Frequency: priority = L + uses * cost / size."""

    name = "gdsf"

    def value(self, e: _Entry) -> float:
        return e.uses * self.cost_of(e) / max(e.size, 1)


class GDF(_GreedyDual):
    """GreedyDual-Frequency: priority = L + uses * cost (a count-capacity tier's GDSF)."""

    name = "gdf"

    def value(self, e: _Entry) -> float:
        return e.uses * self.cost_of(e)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRU,
    "lfu": LFUDA,
    "gdsf": GDSF,
    "gdf": GDF,
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its name (one per tier); ValueError naming the choices otherwise."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(
            f"unknown adapter eviction policy {name!r}; choose one of: {', '.join(POLICIES)}"
        )
    return factory()


def tier_policy(name: str = "lru") -> EvictionPolicy:
    """A policy for one of the engine's adapter tiers, whose keys are ``AdapterVersion``
    objects: ``lru`` orders by each version's ``last_used`` (see the module docstring), the
    others as ``make_policy``. ValueError naming the choices for an unknown name."""
    if name == "lru":
        return LRU(recency=attrgetter("last_used"))
    return make_policy(name)
