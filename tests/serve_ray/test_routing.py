"""The routing order (no Ray): residency tiers, load, the imbalance bound, the baselines; the
typed errors' trip from a replica to the ingress; the cluster-wide stats."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from loraplex.engine.errors import (
    AdapterNotFoundError,
    AdapterPolicyError,
    EngineClosedError,
    InvalidRequestError,
    SlotFullError,
)
from loraplex.engine.serve_ray.routing import ReplicaView, rank_replicas, residency_key
from loraplex.engine.server.errors import from_exception

pytest.importorskip("ray.serve")

from loraplex.engine.serve_ray.board import Board  # noqa: E402
from loraplex.engine.serve_ray.cluster_engine import (  # noqa: E402
    ClusterEngine,
    ReplicaFailedError,
    _merge_stats,
)
from loraplex.engine.serve_ray.replica import WireError  # noqa: E402


def ids(choice) -> list[str]:
    return [v.id for v in choice.order]


def test_slot_then_cpu_then_loading_then_least_loaded():
    a = ReplicaView("a", load=0)
    b = ReplicaView("b", gpu=frozenset({"x"}), load=3)
    c = ReplicaView("c", cpu=frozenset({"x"}), load=1)
    d = ReplicaView("d", loading=frozenset({"x"}), load=2)
    choice = rank_replicas("x", [a, b, c, d])
    assert ids(choice) == ["b", "c", "d", "a"]
    assert choice.tiers == ["slot", "cpu", "loading", "miss"]
    # an adapter resident nowhere: the least-loaded replica
    assert ids(rank_replicas("y", [b, a, c]))[0] == "a"


def test_load_breaks_ties_within_a_tier():
    a = ReplicaView("a", gpu=frozenset({"x"}), load=5)
    b = ReplicaView("b", gpu=frozenset({"x"}), load=2)
    assert ids(rank_replicas("x", [a, b])) == ["b", "a"]


def test_a_busy_holder_loses_its_preference_beyond_the_imbalance_bound():
    hot = ReplicaView("hot", gpu=frozenset({"x"}), load=9)
    idle = ReplicaView("idle", load=0)
    assert ids(rank_replicas("x", [hot, idle], max_imbalance=9))[0] == "hot"
    assert ids(rank_replicas("x", [hot, idle], max_imbalance=8))[0] == "idle"
    # once the adapter is resident on both, the lighter holder wins
    both = ReplicaView("idle", gpu=frozenset({"x"}), load=1)
    assert ids(rank_replicas("x", [hot, both], max_imbalance=8))[0] == "idle"


def test_cold_adapters_spread_over_equally_loaded_replicas_and_stick():
    views = [ReplicaView("r0"), ReplicaView("r1")]
    first = {f"ad{i}": ids(rank_replicas(f"ad{i}", views))[0] for i in range(64)}
    spread = Counter(first.values())
    assert set(spread) == {"r0", "r1"} and min(spread.values()) >= 16, spread
    # the same cold adapter goes to the same replica every time (until residency says more)
    again = {name: ids(rank_replicas(name, views[::-1]))[0] for name in first}
    assert again == first


def test_a_composition_routes_by_its_combination_name():
    from loraplex.engine.adapters.registry import combination_name

    parts = [("sql", 0.7), ("pirate", 0.3)]
    assert residency_key(parts) == combination_name(parts) == "sql*0.7+pirate*0.3"
    assert residency_key("sql") == "sql" and residency_key(None) is None
    holder = ReplicaView("b", gpu=frozenset({combination_name(parts)}), load=2)
    assert ids(rank_replicas(residency_key(parts), [ReplicaView("a"), holder]))[0] == "b"


def test_baselines_ignore_residency():
    a = ReplicaView("a", gpu=frozenset({"x"}), load=4)
    b = ReplicaView("b", load=1)
    assert ids(rank_replicas("x", [a, b], policy="least_loaded"))[0] == "b"
    firsts = {ids(rank_replicas("x", [a, b], policy="random", rng=random.Random(s)))[0]
              for s in range(20)}  # fmt: skip
    assert firsts == {"a", "b"}


def test_bad_policy_and_bound_are_typed_errors():
    with pytest.raises(ValueError, match="routing policy"):
        rank_replicas("x", [ReplicaView("a")], policy="sticky")
    with pytest.raises(ValueError, match="max_imbalance"):
        rank_replicas("x", [ReplicaView("a")], max_imbalance=-1)
    with pytest.raises(ValueError, match="routing policy"):
        Board("t").set_policy("nope")
    assert rank_replicas("x", []).order == []


def test_board_hints_a_cold_adapter_until_its_replica_reports_it():
    board = Board("hints")
    board.view("r0", {"gpu": [], "cpu": [], "load": 0}, now=0.0)
    board.routed("r0", "i1", "req-1", "x", "miss")
    view = board.view("r0", {}, now=1.0)
    assert view.tier("x") == "loading" and view.load == 1  # in flight here
    assert board.replica_of("req-1") == "r0" and board.route_of("req-1") == ("r0", "miss")
    board.completed("r0", "i1")
    view = board.view("r0", {"gpu": ["x"], "cpu": [], "load": 0}, now=1.5)
    assert view.tier("x") == "slot" and view.load == 0 and not view.loading
    board.replicas_changed(set())
    assert board.snapshot()[0] == {}


def test_wire_errors_come_back_typed():
    err = WireError.of(AdapterNotFoundError("unknown adapter 'q'", field="model")).exception()
    assert type(err) is AdapterNotFoundError and err.field == "model"
    err = WireError.of(InvalidRequestError("bad", field="prompt")).exception()
    assert type(err) is InvalidRequestError and err.field == "prompt" and str(err) == "bad"
    assert type(WireError.of(AdapterPolicyError("no")).exception()) is AdapterPolicyError
    # a class from elsewhere is never imported by name: a plain error with the text
    foreign = WireError("os", "system", "boom").exception()
    assert type(foreign) is RuntimeError and "boom" in str(foreign)
    assert issubclass(ReplicaFailedError, EngineClosedError)  # the server maps it to 503


def test_slot_full_error_crosses_as_503():
    """Every GPU slot pinned: the replica's SlotFullError is the ingress's HTTP 503, as on
    ``loraplex serve`` (it used to arrive as a RuntimeError, i.e. a 500)."""
    err = WireError.of(SlotFullError("all 2 GPU slots are pinned")).exception()
    assert type(err) is SlotFullError and "pinned" in str(err)
    assert from_exception(err).status == 503


def test_cluster_stats_sum_counts_and_join_lists():
    merged = _merge_stats([
        {"stats": {"running": 2, "gpu_resident": ["a"], "adapters": {"gpu_hits": 3}}},
        {"stats": {"running": 1, "gpu_resident": ["b", "a"], "adapters": {"gpu_hits": 1}}},
    ])  # fmt: skip
    assert merged == {"running": 3, "gpu_resident": ["a", "b"], "adapters": {"gpu_hits": 4}}


class _NeverDelivered:
    """A per-replica call that Ray can never route (its replica died): it never completes."""

    def __init__(self) -> None:
        self.cancelled = False
        self._never = asyncio.get_running_loop().create_future()

    def cancel(self) -> None:
        self.cancelled = True
        self._never.cancel()

    def __await__(self):
        return self._never.__await__()


class _Handle:
    def __init__(self) -> None:
        self.calls: list[_NeverDelivered] = []

    def __getattr__(self, method: str):
        handle = self

        class _Method:
            @staticmethod
            def remote(*args, replica=None):
                handle.calls.append(_NeverDelivered())
                return handle.calls[-1]

        return _Method

    def options(self, **_):
        return self


async def test_a_call_to_a_replica_that_left_fails_at_once_and_is_cancelled():
    """Ray's router drops a dead replica before the controller's next broadcast: the router
    forgets it on the board (``gone``), and a per-replica call to it (an adapter load of the
    reconcile loop) fails with ReplicaFailedError instead of holding one of Ray's routing
    tasks until a 120 s timeout (which starved the ingress's requests after a replica died)."""
    board = Board("gone")
    board.view("r0", {"gpu": [], "cpu": [], "load": 0}, now=0.0)
    board.view("r1", {"gpu": [], "cpu": [], "load": 0}, now=0.0)
    engine = ClusterEngine(_Handle(), board)
    call = asyncio.ensure_future(engine._on("r1", "add_adapter", "x", "/a", None, True))
    await asyncio.sleep(0.3)
    assert not call.done()  # still routable: it waits
    board.gone("r1")  # what ResidencyRouter.choose_replicas does for a target it lacks
    with pytest.raises(ReplicaFailedError, match="r1"):
        await asyncio.wait_for(call, 2.0)
    assert engine._handle.calls[0].cancelled
    assert set(board.snapshot()[0]) == {"r0"} and engine._replicas() == ["r0"]
