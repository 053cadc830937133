"""The routing board: what the router did and knows, shared with the ingress in one process.

The router (on Ray's router thread) writes the replicas' latest routing stats, its decisions and
the requests in flight; the ingress (on its event loop) reads them for ``/metrics``, to give
replacement replicas the runtime adapters, and to tell which replica serves a request.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.serve_ray.routing import POLICIES, ReplicaView

__all__ = ["Board"]

_LOADING_TTL_S = 5.0  # how long "sent here, being loaded" counts without a report showing it
_REMEMBERED_REQUESTS = 4096


@dataclass
class Board:
    """Routing state shared by the router (Ray's router thread) and the ingress (its loop)."""

    name: str
    policy: str = "residency"
    max_imbalance: int = 8
    lock: threading.Lock = field(default_factory=threading.Lock)
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica -> routing stats
    decisions: Counter = field(default_factory=Counter)  # (replica, tier) -> requests
    in_flight: dict[str, set[str]] = field(default_factory=dict)  # replica -> internal ids
    loading: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> {adapter: t}
    served_by: OrderedDict = field(default_factory=OrderedDict)  # request id -> (replica, tier)

    @classmethod
    def named(cls, name: str) -> Board:
        """The process's board of that name (made on first use)."""
        with _BOARDS_LOCK:
            board = _BOARDS.get(name)
            if board is None:
                board = _BOARDS[name] = cls(name)
            return board

    def set_policy(self, policy: str, max_imbalance: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; expected one of {POLICIES}")
        if max_imbalance is not None and max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        with self.lock:
            self.policy = policy
            if max_imbalance is not None:
                self.max_imbalance = max_imbalance

    # -- written by the router -------------------------------------------------------------------

    def view(self, replica: str, stats: dict[str, Any], now: float) -> ReplicaView:
        """What the router knows of ``replica`` (``stats``: its latest routing stats; empty:
        the last ones recorded)."""
        with self.lock:
            if stats:
                self.reports[replica] = stats
            else:
                stats = self.reports.get(replica, {})
            gpu = frozenset(stats.get("gpu", ()))
            cpu = frozenset(stats.get("cpu", ()))
            hints = self.loading.setdefault(replica, {})
            for name, t in list(hints.items()):
                if name in gpu or name in cpu or now - t > _LOADING_TTL_S:
                    del hints[name]
            load = max(int(stats.get("load", 0)), len(self.in_flight.get(replica, ())))
            return ReplicaView(replica, gpu, cpu, frozenset(hints), load)

    def routed(
        self, replica: str, internal_id: str, request_id: str | None, adapter: str | None, tier: str
    ) -> None:
        with self.lock:
            self.decisions[(replica, tier)] += 1
            self.in_flight.setdefault(replica, set()).add(internal_id)
            if adapter is not None and tier in ("miss", "loading"):
                self.loading.setdefault(replica, {})[adapter] = time.monotonic()
            if request_id is not None:
                self.served_by[request_id] = (replica, tier)
                while len(self.served_by) > _REMEMBERED_REQUESTS:
                    self.served_by.popitem(last=False)

    def completed(self, replica: str, internal_id: str) -> None:
        with self.lock:
            self.in_flight.get(replica, set()).discard(internal_id)

    def replicas_changed(self, live: set[str]) -> None:
        with self.lock:
            for table in (self.reports, self.in_flight, self.loading):
                for gone in set(table) - live:
                    del table[gone]

    def gone(self, replica: str) -> None:
        """``replica`` is no longer routable (Ray's router dropped it, e.g. its actor died,
        before the controller's next broadcast of the replica set): forget it now, so that
        the ingress stops sending it per-replica calls."""
        with self.lock:
            for table in (self.reports, self.in_flight, self.loading):
                table.pop(replica, None)

    # -- read by the ingress ---------------------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, dict[str, Any]], Counter]:
        """Latest routing stats per live replica, and the routing decisions so far."""
        with self.lock:
            return dict(self.reports), Counter(self.decisions)

    def replica_of(self, request_id: str) -> str | None:
        route = self.route_of(request_id)
        return route[0] if route is not None else None

    def route_of(self, request_id: str) -> tuple[str, str] | None:
        """(replica, tier of the request's adapter there when it was sent) of a request."""
        with self.lock:
            return self.served_by.get(request_id)


_BOARDS: dict[str, Board] = {}
_BOARDS_LOCK = threading.Lock()
