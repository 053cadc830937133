"""Routing by residency on the live cluster (conftest.py; the ranking itself, without Ray, is
test_routing.py): a request follows its adapter to the replica that holds it, a Zipf workload
over the ``a``/``b`` adapters hits slots more often than random routing, and the ingress's
metrics show each replica's residency and the routing decisions. It runs before test_cluster.py
(conftest.py sees to it), whose last tests take replicas and the app away."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import pytest

pytest.importorskip("ray.serve")

from loraplex.engine.sampling_params import SamplingParams  # noqa: E402
from loraplex.engine.serve_ray.routing import ReplicaView, rank_replicas  # noqa: E402
from tests.helpers.ray_cluster import PER_SET, PROMPT, Cluster, wait_for


def _get(url: str, path: str) -> str:
    with urllib.request.urlopen(f"{url}{path}", timeout=30) as r:
        return r.read().decode()


def test_requests_follow_their_adapter_to_the_replica_that_holds_it(cluster: Cluster):
    engine, loop = cluster.engine, cluster.loop
    r0, r1 = cluster.replicas()
    # an adapter whose cold preference (hash) is r0, made resident on r1 by a targeted request
    views = [ReplicaView(r0), ReplicaView(r1)]
    name = next(
        f"a{i:02d}" for i in range(PER_SET)
        if rank_replicas(f"a{i:02d}", views).order[0].id == r0
    )  # fmt: skip

    async def warm() -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in engine.generate([1, 2, 3], params, adapter=name, replica=r1):
            pass

    loop.run(warm())

    def resident() -> bool:
        return name in engine.board.snapshot()[0][r1].get("gpu", ())

    wait_for(resident, 30, f"{name} resident on {r1}")
    client = cluster.client()
    for _ in range(6):
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=2)
        assert engine.replica_of(f"{reply.id}-0-0") == r1


def _replica_adapter_stats(cluster: Cluster) -> dict[str, int]:
    async def read() -> dict[str, int]:
        total: dict[str, int] = {}
        for r in cluster.replicas():
            stats = await cluster.handle.stats.remote(replica=r)
            for k, v in stats["adapters"].items():
                total[k] = total.get(k, 0) + v
        return total

    return cluster.loop.run(read())


def _zipf_run(cluster: Cluster, prefix: str, policy: str, n: int, alpha: float) -> float:
    """Slot-hit rate of ``n`` requests over the ``prefix`` adapters, Zipf(alpha), 4 at once."""
    engine = cluster.engine
    weights = [1 / (k + 1) ** alpha for k in range(PER_SET)]
    rng = random.Random(7)
    names = [f"{prefix}{k:02d}" for k in rng.choices(range(PER_SET), weights, k=n)]
    engine.board.set_policy(policy)
    before = _replica_adapter_stats(cluster)

    async def run() -> None:
        todo = iter(enumerate(names))

        async def worker() -> None:
            for i, name in todo:
                params = SamplingParams(max_tokens=2, temperature=0.0)
                async for _ in engine.generate([1, 2, 3, 4], params, name, f"{prefix}-{i}"):
                    pass

        await asyncio.gather(*(worker() for _ in range(4)))

    try:
        cluster.loop.run(run())
    finally:
        engine.board.set_policy("residency")
    after = _replica_adapter_stats(cluster)
    hits = {k: after.get(k, 0) - before.get(k, 0) for k in ("gpu_hits", "cpu_hits", "misses")}
    return hits["gpu_hits"] / max(1, sum(hits.values()))


def test_zipf_workload_hits_slots_more_often_than_random_routing(cluster: Cluster):
    random_rate = _zipf_run(cluster, "a", "random", 160, 1.1)
    residency_rate = _zipf_run(cluster, "b", "residency", 160, 1.1)
    print(f"\nslot-hit rate, Zipf 1.1 over {PER_SET} adapters, 4 slots x 2 replicas: "
          f"residency {residency_rate:.3f}, random {random_rate:.3f}")  # fmt: skip
    assert residency_rate > random_rate
    # every routed request was also seen to complete: the router's load count drains
    board = cluster.engine.board
    wait_for(lambda: not any(board.in_flight.values()), 10, "in-flight counts back to 0")


def test_ingress_metrics_show_residency_and_routing_decisions(cluster: Cluster):
    cluster.client().completions.create(model="pirate", prompt=PROMPT, max_tokens=2)
    text = _get(cluster.url, "/metrics")
    assert "loraplex_replicas 2.0" in text
    for r in cluster.replicas():
        assert f'loraplex_replica_adapters_resident{{replica="{r}",tier="gpu"}}' in text
        assert f'loraplex_replica_load{{replica="{r}"}}' in text
    tiers = {line.split('tier="')[1].split('"')[0]
             for line in text.splitlines() if line.startswith("loraplex_route_decisions_total{")}  # fmt: skip
    assert {"slot", "miss"} <= tiers, tiers
    # the engine metrics summed over the replicas, and the ingress's own request metrics
    assert "vllm:num_requests_running" in text and "loraplex_requests_total{" in text
    assert _get(cluster.url, "/health") == ""
