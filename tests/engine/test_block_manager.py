"""Tests of the paged KV block manager and its prefix cache (pure Python)."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.kv import (
    BlockManager,
    DuplicateRequestError,
    NoFreeBlocksError,
    UnknownRequestError,
)

BS = 4
A1 = ("sql", "sha256:aaaa")
A1_V2 = ("sql", "sha256:bbbb")
A2 = ("chat", "sha256:aaaa")


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run_prefill(bm: BlockManager, req_id: str, tokens: list[int], adapter=None) -> int:
    """Allocate and pretend the whole prompt was computed."""
    cached = bm.allocate(req_id, tokens, adapter)
    bm.mark_computed(req_id, tokens, len(tokens))
    return cached


def check_invariants(bm: BlockManager) -> None:
    free, evictable = set(bm._free), set(bm._evictable)
    assert len(free) == len(bm._free) and not free & evictable
    holders = [0] * bm.num_blocks
    for req_id in list(bm._reqs):
        table = bm.block_table(req_id)
        assert len(set(table)) == len(table)
        for b in table:
            holders[b] += 1
    for b in range(bm.num_blocks):
        assert bm.refcount(b) == holders[b]
        states = [b in free, b in evictable, holders[b] > 0]
        assert sum(states) == 1, (b, states)
        if b in free:
            assert bm._hash[b] is None
        if b in evictable:
            assert bm._hash[b] is not None
    for h, b in bm._cached.items():
        assert bm._hash[b] == h
    assert sum(h is not None for h in bm._hash) == len(bm._cached)
    assert bm.num_free_blocks == len(free) + len(evictable)
    assert bm.num_used_blocks == sum(1 for n in holders if n)


def test_allocate_free_accounting_returns_to_all_free():
    bm = BlockManager(10, BS)
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(4) == 1 and bm.blocks_needed(5) == 2
    assert bm.allocate("a", prompt(9), None) == 0
    assert len(bm.block_table("a")) == 3
    bm.allocate("b", prompt(4, 100), None)
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 6
    bm.append("a", 13)
    assert len(bm.block_table("a")) == 4
    check_invariants(bm)
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    check_invariants(bm)


def test_prefix_hit_same_adapter_counts_stats():
    bm = BlockManager(16, BS)
    tokens = prompt(10)  # 2 full blocks + 2 tokens
    assert run_prefill(bm, "a", tokens, A1) == 0
    assert bm.stats.queries == 2 and bm.stats.hits == 0
    expected = bm.block_table("a")[:2]
    assert bm.get_computed_prefix(tokens, A1) == expected
    assert run_prefill(bm, "b", tokens, A1) == 8
    assert bm.block_table("b")[:2] == expected
    assert bm.block_table("b")[2] != bm.block_table("a")[2]  # partial block not shared
    assert bm.stats.queries == 4 and bm.stats.hits == 2
    assert bm.stats.hit_rate == 0.5
    check_invariants(bm)


@pytest.mark.parametrize(
    ("first", "second"),
    [(A1, A2), (A1, A1_V2), (None, A1), (A1, None)],
    ids=["other-adapter", "other-digest", "base-vs-adapter", "adapter-vs-base"],
)
def test_no_sharing_across_adapter_identities(first, second):
    bm = BlockManager(16, BS)
    tokens = prompt(12)
    run_prefill(bm, "a", tokens, first)
    assert bm.get_computed_prefix(tokens, second) == []
    assert bm.allocate("b", tokens, second) == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    # and the same identity still hits
    assert len(bm.get_computed_prefix(tokens, first)) == 2
    check_invariants(bm)


def test_bad_adapter_key_rejected():
    bm = BlockManager(4, BS)
    with pytest.raises(TypeError):
        bm.get_computed_prefix(prompt(9), "sql")  # type: ignore[arg-type]


def test_refcounts_with_shared_prefix():
    bm = BlockManager(16, BS)
    shared = prompt(8)
    run_prefill(bm, "a", shared + [50, 51, 52], A1)
    run_prefill(bm, "b", shared + [60], A1)
    run_prefill(bm, "c", shared + [70, 71], A1)
    s0, s1 = bm.block_table("a")[:2]
    assert bm.block_table("b")[:2] == bm.block_table("c")[:2] == [s0, s1]
    assert bm.refcount(s0) == bm.refcount(s1) == 3
    bm.free("a")
    assert bm.refcount(s0) == 2
    bm.free("b")
    bm.free("c")
    assert bm.refcount(s0) == 0
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # s0, s1 stay evictable
    check_invariants(bm)
    # a hit on an evictable block revives it
    assert bm.allocate("d", shared + [1], A1) == 8
    assert bm.refcount(s0) == bm.refcount(s1) == 1
    check_invariants(bm)


def test_lru_eviction_order():
    bm = BlockManager(6, BS)
    a, b = prompt(9, 0), prompt(9, 100)  # 2 full blocks + 1 token each
    run_prefill(bm, "a", a)
    run_prefill(bm, "b", b)
    a0, a1, _ = bm.block_table("a")
    b0, b1, _ = bm.block_table("b")
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    # touch a's prefix again: a's blocks are now more recent than b's
    run_prefill(bm, "a2", a)
    bm.free("a2")
    order = [b1, b0, a1, a0]  # least recent first, tail of a prefix before its head
    x = bm.allocate("x", prompt(8, 500), None)  # takes the two free blocks
    assert x == 0 and bm.stats.evictions == 0
    for i, victim in enumerate(order):
        bm.allocate(f"y{i}", prompt(4, 600 + 10 * i), None)
        assert bm.block_table(f"y{i}") == [victim]
        assert bm.stats.evictions == i + 1
        check_invariants(bm)
    assert bm.get_computed_prefix(a, None) == [] and bm.num_cached_blocks == 0


def test_never_hit_blocks_not_marked_computed():
    bm = BlockManager(16, BS)
    tokens = prompt(13)
    bm.allocate("a", tokens, A1)
    assert bm.get_computed_prefix(tokens, A1) == []
    bm.mark_computed("a", tokens, 6)  # chunked prefill: only block 0 is full and computed
    assert bm.get_computed_prefix(tokens, A1) == bm.block_table("a")[:1]
    bm.mark_computed("a", tokens, 13)
    assert bm.get_computed_prefix(tokens, A1) == bm.block_table("a")[:3]


def test_leave_at_least_one_token():
    bm = BlockManager(16, BS)
    tokens = prompt(8)  # exactly 2 full blocks
    run_prefill(bm, "a", tokens)
    assert bm.get_computed_prefix(tokens, None) == bm.block_table("a")[:1]
    assert bm.allocate("b", tokens, None) == 4
    assert len(bm.block_table("b")) == 2
    assert bm.block_table("b")[1] != bm.block_table("a")[1]
    assert bm.get_computed_prefix(tokens[:1], None) == []
    assert len(bm.get_computed_prefix(tokens + [99], None)) == 2


def test_partial_block_not_shared_then_registered_on_decode():
    bm = BlockManager(16, BS)
    tokens = prompt(6)
    run_prefill(bm, "a", tokens)
    assert bm.get_computed_prefix(tokens + [6, 7, 8], None) == bm.block_table("a")[:1]
    for t in (6, 7):  # decode two tokens: block 1 becomes full once 8 tokens are computed
        tokens.append(t)
        assert bm.can_append("a")
        bm.append("a", len(tokens))
        bm.mark_computed("a", tokens, len(tokens) - 1)
        check_invariants(bm)
    assert len(bm.get_computed_prefix(tokens + [8], None)) == 1
    tokens.append(8)
    bm.append("a", len(tokens))
    assert len(bm.block_table("a")) == 3
    bm.mark_computed("a", tokens, 8)
    assert bm.get_computed_prefix(tokens, None) == bm.block_table("a")[:2]


def test_out_of_blocks():
    bm = BlockManager(4, BS)
    bm.allocate("a", prompt(12), None)
    assert bm.can_allocate("b", prompt(4, 50), None)
    assert not bm.can_allocate("b", prompt(5, 50), None)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", prompt(5, 50), None)
    assert "b" not in bm and bm.num_free_blocks == 1  # nothing changed
    assert bm.can_append("a", 4) and not bm.can_append("a", 5)
    with pytest.raises(NoFreeBlocksError):
        bm.append("a", 17)
    assert len(bm.block_table("a")) == 3
    bm.append("a", 16)
    assert bm.num_free_blocks == 0 and not bm.can_append("a")
    check_invariants(bm)


def test_evictable_hit_counted_when_checking_space():
    bm = BlockManager(3, BS)
    tokens = prompt(9)
    run_prefill(bm, "a", tokens)
    bm.free("a")
    assert bm.num_free_blocks == 3
    # 2 blocks hit (both evictable, so they leave the pool) + 1 new = 3: fits
    assert bm.can_allocate("b", tokens, None)
    bm.allocate("b", tokens, None)
    bm.free("b")
    # prompt of 12 would need 3 blocks with 2 hits revived + 1 new: still fits
    assert bm.can_allocate("c", prompt(12), None)
    bm.allocate("x", prompt(5, 100), None)  # free block + evicts the cached tail (block 1)
    assert bm.stats.evictions == 1
    assert len(bm.get_computed_prefix(tokens, None)) == 1
    # 1 evictable hit revived + 2 new blocks, but only that 1 evictable block is left
    assert not bm.can_allocate("c", tokens + [9, 10, 11], None)
    check_invariants(bm)


def test_evictable_hit_needs_a_block_of_the_pool():
    bm = BlockManager(4, BS)
    run_prefill(bm, "a", prompt(5))  # block 0 cached, block 1 partial
    bm.free("a")
    bm.allocate("x", prompt(8, 100), None)  # takes the two other free blocks
    assert bm.num_free_blocks == 2  # one free, one evictable (the cached block 0)
    # 1 hit (evictable) + 2 new blocks needs 3 of the pool's 2
    assert not bm.can_allocate("c", prompt(9), None)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("c", prompt(9), None)
    assert bm.can_allocate("c", prompt(8), None)  # 1 hit + 1 new
    assert bm.allocate("c", prompt(8), None) == 4
    check_invariants(bm)


def test_errors_double_free_and_unknown():
    bm = BlockManager(4, BS)
    bm.allocate("a", prompt(3), None)
    with pytest.raises(DuplicateRequestError):
        bm.allocate("a", prompt(3), None)
    bm.free("a")
    with pytest.raises(UnknownRequestError):
        bm.free("a")
    with pytest.raises(KeyError):
        bm.block_table("nope")
    for call in (lambda: bm.append("nope", 3), lambda: bm.can_append("nope")):
        with pytest.raises(KeyError, match="nope"):
            call()
    with pytest.raises(KeyError):
        bm.mark_computed("nope", prompt(3), 3)
    with pytest.raises(ValueError):
        bm.allocate("e", [], None)
    bm.allocate("b", prompt(3), None)
    with pytest.raises(ValueError):
        bm.mark_computed("b", prompt(8), 8)  # more tokens than its blocks hold
    assert bm.num_free_blocks == 3


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    tokens = prompt(9)
    run_prefill(bm, "a", tokens, A1)
    assert bm.get_computed_prefix(tokens, A1) == []
    assert run_prefill(bm, "b", tokens, A1) == 0
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_blocks == 0 and bm.stats.queries == bm.stats.hits == 0
    check_invariants(bm)


def test_reset_prefix_cache():
    bm = BlockManager(8, BS)
    tokens = prompt(9)
    run_prefill(bm, "a", tokens)
    run_prefill(bm, "b", prompt(9, 100))
    bm.free("b")
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 5
    assert bm.get_computed_prefix(tokens, None) == []
    check_invariants(bm)
    bm.mark_computed("a", tokens, 9)  # a running request's computed blocks register again
    assert bm.get_computed_prefix(tokens, None) == bm.block_table("a")[:2]
    check_invariants(bm)


def test_concurrent_duplicate_content_registers_once():
    bm = BlockManager(8, BS)
    tokens = prompt(9)
    bm.allocate("a", tokens, None)
    bm.allocate("b", tokens, None)  # nothing computed yet, so no sharing
    bm.mark_computed("a", tokens, 9)
    bm.mark_computed("b", tokens, 9)
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_prefix(tokens, None) == bm.block_table("a")[:2]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8
    check_invariants(bm)


def test_randomized_invariants():
    rng = random.Random(1234)
    bm = BlockManager(48, BS)
    adapters = [None, A1, A1_V2, A2]
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (1, 3, 4, 8, 9, 12, 13)]
    reqs: dict[str, tuple[list[int], object, int]] = {}  # id -> tokens, adapter, computed
    content: dict[int, tuple] = {}  # block id -> (adapter, tokens up to its end) written there
    n_hits = 0
    for step in range(3000):
        op = rng.random()
        if op < 0.3 or not reqs:
            suffix = [rng.randrange(3) for _ in range(rng.choice((0, 0, 1, 4, 7)))]
            tokens = rng.choice(prefixes) + suffix
            if not tokens:
                continue
            adapter, rid = rng.choice(adapters), f"r{step}"
            if not bm.can_allocate(rid, tokens, adapter):
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(rid, tokens, adapter)
                check_invariants(bm)
                continue
            cached = bm.allocate(rid, tokens, adapter)
            assert cached % BS == 0 and cached < len(tokens)
            table = bm.block_table(rid)
            assert len(table) == bm.blocks_needed(len(tokens))
            for i, b in enumerate(table):
                if i < cached // BS:  # a hit must hold exactly this content, computed
                    assert content[b] == (adapter, tuple(tokens[: (i + 1) * BS]))
                    n_hits += 1
                else:
                    content.pop(b, None)
            reqs[rid] = (tokens, adapter, cached)
        else:
            rid = rng.choice(sorted(reqs))
            tokens, adapter, computed = reqs[rid]
            if op < 0.55:  # compute some tokens (chunked prefill or decode step)
                computed = rng.randint(computed, len(tokens))
                bm.mark_computed(rid, tokens, computed)
                for i in range(computed // BS):
                    content[bm.block_table(rid)[i]] = (adapter, tuple(tokens[: (i + 1) * BS]))
            elif op < 0.8:  # decode: add tokens
                n = rng.randint(1, 5)
                if bm.can_append(rid, n):
                    tokens = tokens + [rng.randrange(50) for _ in range(n)]
                    bm.append(rid, len(tokens))
                else:
                    with pytest.raises(NoFreeBlocksError):
                        bm.append(rid, len(tokens) + n)
            elif op < 0.995:
                bm.free(rid)
                del reqs[rid]
            else:
                bm.reset_prefix_cache()
            if rid in reqs:
                reqs[rid] = (tokens, adapter, computed)
        check_invariants(bm)
    assert n_hits > 50 and bm.stats.hits == n_hits and bm.stats.evictions > 0
    for rid in list(reqs):
        bm.free(rid)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    check_invariants(bm)
