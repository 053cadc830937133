"""Ray Serve request router of the engine replicas.

Ray Serve builds one ``ResidencyRouter`` per deployment handle, in the process that holds the
handle (the ingress), and feeds it each replica's ``record_routing_stats`` (polled by the Serve
controller). The router orders replicas with ``routing.rank_replicas`` and writes what it did on
the process's ``Board`` (board.py). A call with ``replica=<id>`` in its keyword arguments goes
to that replica only (the ingress's per-replica calls: adapter loads, stats).

NOTE: Ray pickles this module by value to ship the router class: it keeps no state of its own
(the board lives in board.py, which travels by reference).
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from loraplex.engine.serve_ray.board import Board
from loraplex.engine.serve_ray.routing import ReplicaView, rank_replicas, residency_key

__all__ = ["ResidencyRouter", "ROUTER_CLASS"]

ROUTER_CLASS = "loraplex.engine.serve_ray.router:ResidencyRouter"


def _call(pending: PendingRequest | None) -> tuple[str | None, str | None, str | None]:
    """(adapter, request id, target replica) of a pending call; a composition's adapter is
    its combination's name (what the engines report as resident)."""
    if pending is None:
        return None, None, None
    target = pending.kwargs.get("replica")
    if pending.metadata.call_method == "generate" and len(pending.args) >= 4:
        return residency_key(pending.args[2]), pending.args[3], target
    return None, None, target


class ResidencyRouter(RequestRouter):
    """Sends a request where its adapter is resident (``routing.py`` says how)."""

    def initialize_state(
        self, board: str = "loraplex", policy: str = "residency", max_imbalance: int = 8, **_: Any
    ) -> None:
        self.board = Board.named(board)
        self.board.set_policy(policy, max_imbalance)

    def _views(self, replicas: list[RunningReplica]) -> list[ReplicaView]:
        now = time.monotonic()
        return [
            self.board.view(r.replica_id.unique_id, r.routing_stats or {}, now) for r in replicas
        ]

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        adapter, _, target = _call(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if target is not None:
            if target in by_id:
                return [[by_id[target]]]
            # NOTE: not routable (died or stopping). Returning no replica would leave the call
            # in Ray's queue of pending requests, retried with back-off until the ingress
            # cancels it, and new requests were seen to time out behind it (CI). It goes to any
            # live replica instead, which refuses a call meant for another (replica.py
            # _check_target): the caller fails at once (ClusterEngine._on).
            self.board.gone(target)
            return [sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)]
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return [sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)]
        board = self.board
        choice = rank_replicas(
            adapter, self._views(candidate_replicas), policy=board.policy,
            max_imbalance=board.max_imbalance,
        )  # fmt: skip
        # one replica per rank: Ray takes the first that has room, in this order
        return [[by_id[v.id]] for v in choice.order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        adapter, request_id, _ = _call(pending_request)
        if pending_request.metadata.call_method != "generate":
            return
        replica = replica_id.unique_id
        internal = pending_request.metadata.internal_request_id
        # what the replica held when the request went there (its latest report, and the adapters
        # sent there since)
        view = self.board.view(replica, {}, time.monotonic())
        self.board.routed(replica, internal, request_id, adapter, view.tier(adapter))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.board.completed(replica_id.unique_id, internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray calls this with every broadcast of the replicas, their new routing stats included
        (a changed report is broadcast on the controller's next loop)."""
        super().update_replicas(replicas)
        self.board.replicas_changed({r.replica_id.unique_id for r in replicas})
        self._views(replicas)  # records the reports
