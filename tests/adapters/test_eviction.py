"""Adapter eviction policies (engine/adapters/eviction.py): each policy's order on scripted
traces, LRU against the tiers' ``min(last_used)`` order, ageing, cost and size, the registry."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.adapters.eviction import GDF, GDSF, LFUDA, LRU, POLICIES, make_policy
from loraplex.engine.adapters.version import AdapterVersion


def _versions(n: int) -> list[AdapterVersion]:
    return [AdapterVersion(f"a{i}", f"file:///a{i}", f"{i:064x}", i) for i in range(n)]


def _drain(policy, candidates: list, now: float = 0.0) -> list:
    """Every candidate, in the order the policy evicts them."""
    left, out = list(candidates), []
    while left:
        v = policy.victim(left, now=now)
        left.remove(v)
        out.append(v)
    return out


def test_lru_reproduces_the_tiers_min_last_used_order() -> None:
    # the GPU tier: victim = min(idle, key=last_used); the host tier: sorted(...)[:excess]
    rng = random.Random(7)
    vs = _versions(12)
    lru = LRU()
    for step in range(400):
        v = rng.choice(vs)
        now = float(step // 3)  # equal times happen: ties go to the first candidate
        v.last_used = now
        lru.touch(v, now=now, size=27_300_000, cost=0.18)
        if step % 5 == 0:
            idle = rng.sample(vs, rng.randint(1, len(vs)))
            if any(x not in lru._last for x in idle):
                continue  # (every candidate touched: the tiers set last_used on every use)
            n = rng.randint(1, len(idle))
            want = sorted(idle, key=lambda x: x.last_used)[:n]
            assert want[0] is min(idle, key=lambda x: x.last_used)
            got = _drain(lru, idle)[:n]
            assert got == want
            for x in idle:  # the drain forgot them all: touch them back as they were
                lru.touch(x, now=x.last_used, size=0, cost=None)


def test_lru_scripted_order() -> None:
    lru = make_policy("lru")
    for now, key in enumerate(["a", "b", "c", "a", "d"]):
        lru.touch(key, now=float(now), size=1, cost=None)
    assert _drain(lru, ["a", "b", "c", "d"]) == ["b", "c", "a", "d"]
    lru.touch("x", now=9.0, size=1, cost=None)
    assert lru.victim(["x", "never-touched"], now=9.0) == "never-touched"


def test_lfu_scripted_order_and_clock() -> None:
    lfu = LFUDA()
    for now, key in enumerate(["a", "a", "a", "b", "c"]):
        lfu.touch(key, now=float(now), size=1, cost=None)
    assert lfu.victim(["a", "b", "c"], now=5.0) == "b"  # 1 use, older than c
    assert lfu.clock == 1.0
    assert lfu.victim(["a", "c"], now=5.0) == "c"
    lfu.touch("d", now=6.0, size=1, cost=None)  # enters at the clock: 1 + 1
    assert lfu.priority("d") == 2.0
    assert _drain(lfu, ["a", "d"]) == ["d", "a"]


def test_lfu_ageing_lets_a_formerly_popular_entry_go() -> None:
    lfu = LFUDA()
    for now in range(3):
        lfu.touch("old", now=float(now), size=1, cost=None)  # popular once: priority 3
    for now, key in enumerate(["x1", "x1"], start=10):
        lfu.touch(key, now=float(now), size=1, cost=None)  # priority 2
    assert lfu.victim(["old", "x1"], now=12.0) == "x1"  # the clock rises to 2
    for now, key in enumerate(["x2", "x2"], start=20):
        lfu.touch(key, now=float(now), size=1, cost=None)  # priority 2 + 2 = 4
    # plain LFU would keep "old" (3 uses against 2) for ever; with the clock it goes
    assert lfu.victim(["old", "x2"], now=22.0) == "old"


_ENTRIES = [  # (key, bytes, measured load seconds, uses)
    ("big", 84_000_000, 0.50, 1),
    ("cheap", 27_300_000, 0.05, 1),
    ("plain", 27_300_000, 0.18, 1),
    ("hot", 27_300_000, 0.18, 3),
]


def _touch_all(policy) -> None:
    now = 0.0
    for key, size, cost, uses in _ENTRIES:
        for _ in range(uses):
            now += 1.0
            policy.touch(key, now=now, size=size, cost=cost)


def test_gdsf_evicts_cheap_then_large_and_rare_first() -> None:
    g = GDSF()
    _touch_all(g)
    # per byte held: cheap 1.8e-9, big 6.0e-9, plain 6.6e-9 s/B; hot: 3 uses of plain
    assert _drain(g, [k for k, *_ in _ENTRIES]) == ["cheap", "big", "plain", "hot"]


def test_gdf_keeps_what_is_dear_to_reload_in_a_count_tier() -> None:
    g = GDF()
    _touch_all(g)
    # uses * seconds: cheap 0.05, plain 0.18, big 0.5, hot 0.54
    assert _drain(g, [k for k, *_ in _ENTRIES]) == ["cheap", "plain", "big", "hot"]


def test_unmeasured_cost_is_priced_from_bytes_at_the_measured_rate() -> None:
    g = GDF()
    g.touch("measured", now=1.0, size=20_000_000, cost=0.2)  # 1e-8 s/B
    g.touch("estimated", now=2.0, size=10_000_000, cost=None)  # ~0.1 s
    assert g.priority("estimated") == pytest.approx(0.1)
    assert g.victim(["measured", "estimated"], now=3.0) == "estimated"
    fresh = GDF()  # nothing measured yet: a nominal rate, still proportional to bytes
    fresh.touch("small", now=1.0, size=1_000, cost=None)
    fresh.touch("large", now=2.0, size=9_000, cost=None)
    assert fresh.victim(["large", "small"], now=3.0) == "small"


def test_clock_never_falls_when_candidates_skip_busy_entries() -> None:
    g = LFUDA()
    for now, key in enumerate(["busy", "a", "a", "a", "b", "b"]):
        g.touch(key, now=float(now), size=1, cost=None)
    assert g.victim(["a", "b"], now=6.0) == "b"  # "busy" (1) is not a candidate
    assert g.clock == 2.0
    assert g.victim(["busy", "a"], now=7.0) == "busy"
    assert g.clock == 2.0  # not back down to busy's 1


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_forget_drops_state(name: str) -> None:
    p = make_policy(name)
    for now in range(5):
        p.touch("a", now=float(now), size=27_300_000, cost=0.18)
    p.touch("b", now=10.0, size=27_300_000, cost=0.18)
    p.touch("b", now=11.0, size=27_300_000, cost=0.18)
    p.forget("a")
    p.forget("never-seen")  # unknown keys are ignored
    assert len(p) == 1
    p.touch("a", now=12.0, size=27_300_000, cost=0.18)  # a fresh entry: its 5 uses are gone
    want = "b" if name == "lru" else "a"  # lru: b is older; the others: a has 1 use, b 2
    assert p.victim(["a", "b"], now=13.0) == want
    assert len(p) == 1  # the victim's state went with it


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_victim_needs_candidates_and_keys_are_objects(name: str) -> None:
    p = make_policy(name)
    with pytest.raises(ValueError):
        p.victim([], now=0.0)
    v1, v2 = _versions(2)
    twin = AdapterVersion(v1.name, v1.uri, v1.digest, 99)  # same identity, another version
    p.touch(v1, now=1.0, size=1, cost=1.0)
    p.touch(v2, now=2.0, size=1, cost=1.0)
    p.touch(v2, now=3.0, size=1, cost=1.0)
    assert p.victim([twin, v1, v2], now=4.0) is twin  # never touched: goes first
    assert p.victim([v1, v2], now=4.0) is v1


def test_make_policy_names_the_choices_and_gives_fresh_instances() -> None:
    with pytest.raises(ValueError, match="'arc'.*lru, lfu, gdsf, gdf"):
        make_policy("arc")
    a, b = make_policy("gdsf"), make_policy("gdsf")
    assert a is not b and isinstance(a, GDSF)
    assert {n: make_policy(n).name for n in POLICIES} == {n: n for n in POLICIES}
