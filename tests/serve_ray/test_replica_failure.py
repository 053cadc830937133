"""A replica that dies with a request: the request is sent to another replica only if the dead
one never acknowledged it (``Accepted``, the first item of a replica's stream, comes before
its engine sees the request). An acknowledged request may be what killed the replica (a
grammar crashing a native library): replayed, it would kill every replica in turn.

The decision on scripted streams (no Ray), then a replica killed (SIGKILL) on the live cluster
of conftest.py while the request waits in its engine's queue: acknowledged, no output yet.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from structlog.testing import capture_logs

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError  # noqa: E402

from loraplex.engine.request import RequestOutput  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402
from loraplex.engine.serve_ray import cluster_engine  # noqa: E402
from loraplex.engine.serve_ray.board import Board  # noqa: E402
from loraplex.engine.serve_ray.cluster_engine import ClusterEngine, ReplicaFailedError  # noqa: E402
from loraplex.engine.serve_ray.replica import Accepted  # noqa: E402
from tests.helpers.ray_cluster import PER_SET, Cluster, wait_for

# -- the decision, on scripted replica streams ------------------------------------------------------


class _Stream:
    """One replica's ``generate`` stream: its items, then (``dies``) the replica dies."""

    def __init__(self, *items: Any, dies: bool = False) -> None:
        self.items = items
        self.dies = dies
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item
        if self.dies:
            raise ActorDiedError()


class _Replicas:
    """A deployment handle whose n-th ``generate`` call gets the n-th scripted stream."""

    def __init__(self, *streams: _Stream) -> None:
        self.streams = list(streams)
        self.calls: list[str] = []

    def options(self, **_: Any) -> _Replicas:
        return self

    def __getattr__(self, method: str) -> Any:
        replicas = self

        class _Method:
            @staticmethod
            def remote(*args: Any, **_: Any) -> Any:
                if method == "info":
                    return _info()
                replicas.calls.append(args[3])  # the request id
                return replicas.streams[len(replicas.calls) - 1]

        return _Method


async def _info() -> dict[str, Any]:
    return {"model_name": "m", "adapters": []}


def _out(text: str, finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput("r", [1], text, finished=finished, finish_reason=reason)


async def _run(replicas: _Replicas) -> tuple[list[Any], BaseException | None]:
    """What the caller of ``ClusterEngine.generate`` sees: the items, then the error if any."""
    seen: list[Any] = []
    async with ClusterEngine(replicas, Board("replica-failure")) as engine:
        try:
            async for out in engine.generate([1, 2], SamplingParams(), None, "req-x"):
                seen.append(out)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return seen, e
    return seen, None


@pytest.fixture(autouse=True)
def _no_retry_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_engine, "_RETRY_PAUSE_S", 0.0)


async def test_a_replica_dead_after_acknowledging_fails_the_request_and_nothing_replays_it():
    """Dead before any output but after ``Accepted``: the crash of a hostile request."""
    replicas = _Replicas(_Stream(Accepted(11), dies=True), _Stream(Accepted(12), _out("x", True)))
    with capture_logs() as logs:
        seen, err = await _run(replicas)
    assert isinstance(err, ReplicaFailedError) and not seen
    assert replicas.calls == ["req-x"]  # the second replica never had it
    assert replicas.streams[0].cancelled
    # logged once, by request id and replica process; the request's content stays out
    failed = [e for e in logs if e["event"] == "replica_failed"]
    assert len(failed) == 1 and failed[0]["request_id"] == "req-x" and failed[0]["pid"] == 11
    assert not {"prompt", "params", "adapter"} & set(failed[0])


async def test_a_replica_dead_mid_stream_fails_the_request_and_nothing_replays_it():
    replicas = _Replicas(_Stream(Accepted(11), _out("a"), dies=True), _Stream(Accepted(12)))
    seen, err = await _run(replicas)
    assert isinstance(err, ReplicaFailedError) and [o.text for o in seen] == ["a"]
    assert replicas.calls == ["req-x"]


async def test_a_replica_dead_before_acknowledging_is_routed_around_and_the_marker_never_leaks():
    """Stale routing (the replica was already gone): the request never reached an engine."""
    replicas = _Replicas(_Stream(dies=True), _Stream(Accepted(12), _out("a"), _out("b", True)))
    seen, err = await _run(replicas)
    assert err is None and [o.text for o in seen] == ["a", "b"]
    assert all(isinstance(o, RequestOutput) for o in seen)
    assert replicas.calls == ["req-x", "req-x"]


async def test_unacknowledged_retries_are_bounded():
    replicas = _Replicas(*(_Stream(dies=True) for _ in range(cluster_engine._RETRIES + 2)))
    _, err = await _run(replicas)
    assert isinstance(err, ReplicaFailedError)
    assert len(replicas.calls) == cluster_engine._RETRIES + 1


# -- the live cluster ---------------------------------------------------------------------------------


class _CountingHandle:
    """The ingress's streaming handle, counting ``generate`` calls per request id."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    @property
    def generate(self) -> Any:
        inner, calls = self.inner.generate, self.calls

        class _Method:
            @staticmethod
            def remote(*args: Any, **kw: Any) -> Any:
                calls[args[3]] += 1
                return inner.remote(*args, **kw)

        return _Method


async def _collect(
    engine: ClusterEngine, params: SamplingParams, **kw: Any
) -> tuple[list[RequestOutput], BaseException | None]:
    outs: list[RequestOutput] = []
    try:
        async for out in engine.generate([1, 2, 3], params, **kw):
            outs.append(out)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return outs, e
    return outs, None


def test_a_killed_replica_fails_its_acknowledged_request_which_no_other_replica_gets(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
):
    engine, loop = cluster.engine, cluster.loop
    victim, survivor = cluster.replicas()
    reports = engine.board.snapshot()[0]
    pid = int(reports[victim]["pid"])
    # an adapter in a slot of the victim and not of the survivor: the request follows it there
    name = next(
        f"b{i:02d}" for i in range(PER_SET)
        if f"b{i:02d}" not in reports[survivor].get("gpu", ())
    )  # fmt: skip

    async def warm() -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in engine.generate([1, 2, 3], params, adapter=name, replica=victim):
            pass

    loop.run(warm())
    wait_for(lambda: name in engine.board.snapshot()[0][victim].get("gpu", ()), 30, "residency")

    async def victim_stats() -> dict[str, Any]:
        return await cluster.handle.stats.remote(replica=victim)

    # the victim's 8 sequences (--max-num-seqs) busy with long streams: a request sent there
    # waits in its engine's queue, acknowledged and without output
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    fillers = [
        asyncio.run_coroutine_threadsafe(_collect(engine, long, replica=victim), loop.loop)
        for _ in range(8)
    ]
    wait_for(lambda: loop.run(victim_stats())["running"] == 8, 60, "8 streams on the victim")
    policy, bound = engine.board.policy, engine.board.max_imbalance
    engine.board.set_policy("residency", 64)  # the busy holder keeps its preference
    counting = _CountingHandle(engine._stream)
    monkeypatch.setattr(engine, "_stream", counting)
    rid = "acknowledged-then-killed"
    try:
        probe = asyncio.run_coroutine_threadsafe(
            _collect(engine, SamplingParams(max_tokens=4), adapter=name, request_id=rid),
            loop.loop,
        )
        wait_for(lambda: engine.replica_of(rid) is not None, 30, "the request routed")
        assert engine.replica_of(rid) == victim
        wait_for(lambda: loop.run(victim_stats())["waiting"] >= 1, 30, "the request queued")
        os.kill(pid, signal.SIGKILL)
        outs, err = probe.result(120)
    finally:
        engine.board.set_policy(policy, bound)
    assert isinstance(err, ReplicaFailedError), (outs, err)
    assert outs == []  # it died before the first output: the case that used to be replayed
    assert counting.calls[rid] == 1  # sent to the victim only, never to the survivor
    assert engine.replica_of(rid) == victim
    for filler in fillers:  # still running when the victim died: acknowledged, not replayed
        assert isinstance(filler.result(120)[1], ReplicaFailedError)
    # later tests of the session need both replicas: Ray replaces the victim
    wait_for(lambda: len(cluster.replicas()) == 2 and victim not in cluster.replicas(), 180,
          "Ray to replace the replica")  # fmt: skip
