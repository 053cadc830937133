"""The eviction study's cache model (engine/bench/coldload/eviction_sim.py) on tiny scripted
traces: known hit / miss counts per policy, single-flight loads, load lanes, slot waits, the
trace generator's determinism and the CLI's table."""

from __future__ import annotations

import pytest

from loraplex.engine.bench.coldload.eviction_sim import CacheModel, main, simulate
from loraplex.engine.bench.coldload.eviction_trace import (
    AdapterSpec,
    Request,
    Trace,
    TraceConfig,
    make_trace,
)

_SPEC = AdapterSpec(nbytes=27_300_000, load_s=1.0, write_s=0.1)


def _trace(picks: str, gap: float = 10.0, out_tokens: int = 1) -> Trace:
    """One request per letter, ``gap`` seconds apart; adapter = letter's index."""
    names = sorted(set(picks))
    reqs = tuple(Request(i * gap, names.index(c), out_tokens) for i, c in enumerate(picks))
    return Trace("scripted", tuple(_SPEC for _ in names), reqs)


def _counts(r) -> tuple[int, int, int]:
    return r.gpu_hits, r.host_hits, r.misses


def test_known_counts_lru_against_lfu() -> None:
    # one slot, three host entries: when d loads, a (3 uses, last at t=20) and b (1 use, t=30)
    # may leave the host tier: LRU drops a (a misses again), LFU drops b (a is a host hit)
    trace = _trace("aaabcda")
    model = CacheModel(max_loras=1, max_cpu_loras=3, load_lanes=4, step_s=0.0)
    lru, lfu = simulate(trace, model, "lru"), simulate(trace, model, "lfu")
    assert _counts(lru) == (2, 0, 5)
    assert _counts(lfu) == (2, 1, 4)
    assert lru.load_s == pytest.approx(5.0) and lfu.load_s == pytest.approx(4.0)
    assert lru.write_s == pytest.approx(0.5) and lfu.write_s == pytest.approx(0.5)
    assert (lru.gpu_evictions, lru.host_evictions) == (4, 2)  # d drops a, then a drops b
    assert lru.ttft == pytest.approx([1.1, 0, 0, 1.1, 1.1, 1.1, 1.1])
    assert lfu.ttft[-1] == pytest.approx(0.1)  # a host hit costs the slot write only
    assert lru.ttft_q(0.5) == pytest.approx(1.1) and lfu.ttft_q(0.5) == pytest.approx(1.1)


def test_per_tier_policies() -> None:
    trace = _trace("aaabcda")
    model = CacheModel(max_loras=1, max_cpu_loras=3, load_lanes=4, step_s=0.0)
    # the host tier decides here (one slot: the GPU tier has one candidate each time)
    assert _counts(simulate(trace, model, "lru/lfu")) == (2, 1, 4)
    assert _counts(simulate(trace, model, "lfu/lru")) == (2, 0, 5)
    with pytest.raises(ValueError, match="choose one of"):
        simulate(trace, model, "lru/nope")


def test_load_lanes_queue_and_single_flight() -> None:
    spec = _SPEC
    trace = Trace(
        "lanes",
        (spec, spec),
        (Request(0.0, 0, 1), Request(0.0, 1, 1), Request(0.5, 0, 1)),
    )
    model = CacheModel(max_loras=2, max_cpu_loras=2, load_lanes=1, step_s=0.0)
    r = simulate(trace, model, "lru")
    # b waits for a's lane (loads 1..2); the second request for a joins a's load
    assert r.ttft == pytest.approx([1.1, 2.1, 0.6])
    assert r.load_s == pytest.approx(2.0) and _counts(r) == (1, 0, 2)


def test_a_slot_changes_owner_only_after_its_requests_end() -> None:
    trace = Trace("busy", (_SPEC, _SPEC), (Request(0.0, 0, 100), Request(0.5, 1, 1)))
    model = CacheModel(max_loras=1, max_cpu_loras=2, load_lanes=2, step_s=0.01)
    r = simulate(trace, model, "gdf")
    # a: landed at 1.1, runs 100 steps to 2.1; b loaded at 1.5 waits for the slot until 2.1
    assert r.ttft == pytest.approx([1.1 + 0.01, (2.1 + 0.1 - 0.5) + 0.01])


def test_traces_are_deterministic_and_shift_moves_popularity() -> None:
    c = TraceConfig(workload="shift", num_adapters=50, alpha=1.1, duration=200, phases=2,
                    shift=10, large_fraction=0.5)  # fmt: skip
    t1, t2 = make_trace(c), make_trace(c)
    assert t1 == t2
    assert {s.nbytes for s in t1.adapters} == {27_300_000, 84_000_000}
    big = next(s for s in t1.adapters if s.nbytes == 84_000_000)
    assert big.load_s > 0.4 and big.write_s == pytest.approx(84e6 / 30e9)
    first = [r.adapter for r in t1.requests if r.t < 100]
    second = [r.adapter for r in t1.requests if r.t >= 100]
    top = max(set(first), key=first.count)
    assert top == 0 and max(set(second), key=second.count) == 10
    zipf = make_trace(TraceConfig(workload="zipf", num_adapters=50, alpha=1.1, duration=200))
    assert [r.t for r in zipf.requests] == [r.t for r in t1.requests]  # same arrival stream
    with pytest.raises(ValueError, match="workload"):
        TraceConfig(workload="nope")


def test_cli_prints_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--adapters", "40", "--duration", "30", "--alpha", "1.0", "--max-loras", "2", "4",
            "--max-cpu-loras", "8", "--policies", "lru", "gdf", "lfu/gdf"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| workload | max_loras | alpha | policy |")
    rows = lines[2:]
    assert len(rows) == 2 * 2 * 3  # workloads x max_loras x policies
    assert all(r.count("|") == lines[0].count("|") for r in rows)
    with pytest.raises(SystemExit):
        main(["--policies", "nope"])
    assert "choose one of" in capsys.readouterr().err
