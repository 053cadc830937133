"""Which replica serves a request: adapter residency first, then load (no Ray in this module).

For a request naming adapter A the preference is

1. a replica holding A in a GPU slot,
2. else one holding A in its CPU tier (a host-to-device copy away),
3. else one that was just sent A and is loading it (a hint that lives until that replica's
   next residency report, so a burst for a cold adapter loads it once, not once per replica),
4. else the least-loaded replica, which then loads A;

within a tier the lighter replica wins, then a rendezvous hash of (A, replica), so that cold
adapters spread over the replicas yet land on the same one until residency says otherwise.
Load is running + waiting requests. A holder whose load exceeds the lightest replica's by more
than ``max_imbalance`` loses its preference for this request: a hot adapter spreads to more
replicas instead of queueing on one.

Policies ``random`` and ``least_loaded`` ignore residency (the benchmark's baselines).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["POLICIES", "TIERS", "ReplicaView", "Choice", "rank_replicas", "residency_key"]

POLICIES = ("residency", "least_loaded", "random")
# what the chosen replica held (the ingress counts these): "base" requests name no adapter
TIERS = ("slot", "cpu", "loading", "miss", "base")


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica."""

    id: str
    gpu: frozenset[str] = frozenset()
    cpu: frozenset[str] = frozenset()
    loading: frozenset[str] = frozenset()  # sent here since its last report, not yet resident
    load: int = 0  # running + waiting

    def tier(self, adapter: str | None) -> str:
        if adapter is None:
            return "base"
        if adapter in self.gpu:
            return "slot"
        if adapter in self.cpu:
            return "cpu"
        if adapter in self.loading:
            return "loading"
        return "miss"


@dataclass(frozen=True)
class Choice:
    """Replicas in order of preference, and the tier of each."""

    order: list[ReplicaView]
    tiers: list[str] = field(default_factory=list)


def residency_key(adapter: str | Sequence[tuple[str, float]] | None) -> str | None:
    """The name an engine reports a request's adapter under: the adapter's name, or for a
    composition ``[(name, weight), ...]`` its combination's name (``sql*0.7+pirate*0.3``)."""
    if adapter is None or isinstance(adapter, str):
        return adapter
    return "+".join(f"{n}*{float(w)!r}" for n, w in adapter)


def _hash(adapter: str | None, replica: str) -> int:
    digest = hashlib.blake2b(f"{adapter}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank_replicas(
    adapter: str | None,
    replicas: Sequence[ReplicaView],
    *,
    policy: str = "residency",
    max_imbalance: int = 8,
    rng: random.Random | None = None,
) -> Choice:
    """Order ``replicas`` for a request on ``adapter`` (None: the base model)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; expected one of {POLICIES}")
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
    views = list(replicas)
    if not views:
        return Choice([], [])
    if policy == "random":
        order = views[:]
        (rng or random).shuffle(order)
    elif policy == "least_loaded":
        order = sorted(views, key=lambda v: (v.load, _hash(adapter, v.id)))
    else:
        lightest = min(v.load for v in views)
        rank = {"slot": 0, "cpu": 1, "loading": 2, "miss": 3, "base": 3}

        def key(v: ReplicaView) -> tuple[int, int, int]:
            tier = rank[v.tier(adapter)]
            if v.load > lightest + max_imbalance:
                tier = rank["miss"]  # too busy to be preferred: spread instead of queueing
            return tier, v.load, _hash(adapter, v.id)

        order = sorted(views, key=key)
    return Choice(order, [v.tier(adapter) for v in order])
