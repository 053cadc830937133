"""Paged KV-cache block manager with automatic prefix caching (pure Python, no torch).

The GPU KV tensors live elsewhere; this module only hands out block ids. Each request
owns a *block table* (list of block ids). Every block is in exactly one state:

* **free**: no contents worth keeping, no hash;
* **in use**: ``refcount > 0`` (number of block tables holding it);
* **evictable**: ``refcount == 0`` but its KV is registered in the prefix cache; kept in
  LRU order and reused (evicted, hash dropped) only when no free block is left.

A FULL block whose KV has been written (:meth:`BlockManager.mark_computed`) is registered
under a chained SHA-256 hash of (parent hash, its token ids, adapter name and digest), so a
later request with the same leading tokens under the same adapter identity reuses it. A
partial last block is never registered or shared, and a lookup always leaves at least one
prompt token to compute.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from .block_hash import AdapterKey, BlockHash, iter_block_hashes

__all__ = [
    "BlockManager",
    "BlockManagerError",
    "DuplicateRequestError",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "UnknownRequestError",
]


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class NoFreeBlocksError(BlockManagerError):
    """Not enough free or evictable blocks; nothing was changed."""


class UnknownRequestError(BlockManagerError, KeyError):
    """The request id holds no blocks (never allocated, or already freed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(BlockManagerError, ValueError):
    """The request id already holds a block table."""


@dataclass
class PrefixCacheStats:
    """Counters, in blocks. ``queries``: full blocks looked up at allocation."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def reset(self) -> None:
        self.queries = self.hits = self.evictions = 0


@dataclass
class _Request:
    adapter: AdapterKey
    table: list[int]
    num_tokens: int  # tokens the table is sized for
    hashes: list[BlockHash]  # chain hashes of table[: len(hashes)], already registered


class BlockManager:
    """Hands out KV block ids to requests, sharing computed prefix blocks."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached: dict[BlockHash, int] = {}
        self._reqs: dict[str, _Request] = {}
        self.stats = PrefixCacheStats()

    # ---------------------------------------------------------------- accounting
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free plus evictable (cached, unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ``refcount > 0``."""
        return self._num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    def refcount(self, block_id: int) -> int:
        return self._ref[block_id]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._reqs

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def block_table(self, req_id: str) -> list[int]:
        return list(self._req(req_id).table)

    # ---------------------------------------------------------------- prefix lookup
    def get_computed_prefix(self, token_ids: Sequence[int], adapter: AdapterKey) -> list[int]:
        """Block ids of the longest cached run of leading full blocks (no side effects).

        Never covers the whole prompt: at least one token is left to compute.
        """
        return self._lookup(token_ids, adapter)[0]

    def _lookup(
        self, token_ids: Sequence[int], adapter: AdapterKey
    ) -> tuple[list[int], list[BlockHash]]:
        if not self.enable_prefix_caching or len(token_ids) <= 1:
            return [], []
        blocks: list[int] = []
        hashes: list[BlockHash] = []
        max_blocks = (len(token_ids) - 1) // self._block_size
        for h in iter_block_hashes(token_ids, self._block_size, adapter, max_blocks):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
            hashes.append(h)
        return blocks, hashes

    # ---------------------------------------------------------------- allocation
    def can_allocate(self, req_id: str, token_ids: Sequence[int], adapter: AdapterKey) -> bool:
        """Whether :meth:`allocate` would succeed now (raises as it does on bad input)."""
        self._check_new(req_id, token_ids)
        hits, _ = self._lookup(token_ids, adapter)
        return self._fits(len(token_ids), hits)

    def _check_new(self, req_id: str, token_ids: Sequence[int]) -> None:
        if req_id in self._reqs:
            raise DuplicateRequestError(f"request {req_id!r} already holds blocks")
        if not token_ids:
            raise ValueError(f"request {req_id!r}: cannot allocate an empty prompt")

    def _fits(self, num_tokens: int, hits: list[int]) -> bool:
        revived = sum(1 for b in hits if self._ref[b] == 0)  # hits that leave the free pool
        return self.blocks_needed(num_tokens) - len(hits) <= self.num_free_blocks - revived

    def allocate(self, req_id: str, token_ids: Sequence[int], adapter: AdapterKey) -> int:
        """Build the block table for all of ``token_ids``; returns the number of cached tokens.

        Raises :class:`NoFreeBlocksError` (changing nothing) if the blocks are not available.
        """
        self._check_new(req_id, token_ids)
        hits, hashes = self._lookup(token_ids, adapter)
        if not self._fits(len(token_ids), hits):
            raise NoFreeBlocksError(
                f"request {req_id!r} needs {self.blocks_needed(len(token_ids)) - len(hits)} "
                f"new blocks, {self.num_free_blocks} free or evictable"
            )
        if self.enable_prefix_caching:
            self.stats.queries += (len(token_ids) - 1) // self._block_size
            self.stats.hits += len(hits)
        for b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        table = hits + self._take(self.blocks_needed(len(token_ids)) - len(hits))
        self._reqs[req_id] = _Request(adapter, table, len(token_ids), hashes)
        return len(hits) * self._block_size

    def can_append(self, req_id: str, num_new_tokens: int = 1) -> bool:
        """Whether the table can grow by ``num_new_tokens`` tokens."""
        req = self._req(req_id)
        extra = self.blocks_needed(req.num_tokens + num_new_tokens) - len(req.table)
        return extra <= self.num_free_blocks

    def append(self, req_id: str, num_total_tokens: int) -> None:
        """Grow the table to hold ``num_total_tokens`` tokens (never shrinks it)."""
        req = self._req(req_id)
        extra = self.blocks_needed(num_total_tokens) - len(req.table)
        if extra > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"request {req_id!r} needs {extra} more blocks, {self.num_free_blocks} free or evictable"
            )
        if extra > 0:
            req.table += self._take(extra)
        req.num_tokens = max(req.num_tokens, num_total_tokens)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Shrink the table to hold ``num_tokens`` tokens, releasing the blocks past them
        (speculative decoding: the blocks that only rejected proposal tokens wrote into). Never
        drops a block registered in the prefix cache: those hold computed, kept tokens."""
        req = self._req(req_id)
        keep = self.blocks_needed(num_tokens)
        if keep < len(req.hashes):
            raise ValueError(
                f"request {req_id!r}: truncating to {num_tokens} tokens would drop cached blocks"
            )
        self._unref(req.table[keep:])
        del req.table[keep:]
        req.num_tokens = min(req.num_tokens, num_tokens)

    def _take(self, n: int) -> list[int]:
        """Take ``n`` blocks (caller checked availability): free first, then LRU eviction."""
        out: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                h = self._hash[b]
                assert h is not None and self._cached.get(h) == b
                del self._cached[h]
                self._hash[b] = None
                self.stats.evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    # ---------------------------------------------------------------- caching
    def mark_computed(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register every full block of ``token_ids[:num_computed]`` in the prefix cache.

        Call after a step wrote the KV of those tokens. Blocks already registered are kept;
        if another block already holds the same content, this one stays unregistered.
        """
        req = self._req(req_id)
        if not 0 <= num_computed <= len(token_ids):
            raise ValueError(f"num_computed={num_computed} outside 0..{len(token_ids)}")
        if num_computed > len(req.table) * self._block_size:
            raise ValueError(
                f"request {req_id!r}: num_computed={num_computed} exceeds its "
                f"{len(req.table)} blocks"
            )
        if not self.enable_prefix_caching:
            return
        full = num_computed // self._block_size
        start = len(req.hashes)
        if full <= start:
            return
        parent = req.hashes[-1] if req.hashes else None
        hashes = iter_block_hashes(
            token_ids[: full * self._block_size], self._block_size, req.adapter, None, start, parent
        )
        for i, h in enumerate(hashes, start):
            b = req.table[i]
            assert self._hash[b] in (None, h), f"block {b} already holds other content"
            if self._hash[b] is None and h not in self._cached:
                self._hash[b] = h
                self._cached[h] = b
            req.hashes.append(h)

    def free(self, req_id: str) -> None:
        """Drop the request's references. Cached blocks become evictable, others free.

        Blocks are released tail first, so a prefix's later blocks are evicted before its
        earlier ones (which other prompts are more likely to share).
        """
        req = self._reqs.pop(req_id, None)
        if req is None:
            raise UnknownRequestError(f"request {req_id!r} holds no blocks (double free?)")
        self._unref(req.table)

    def _unref(self, blocks: list[int]) -> None:
        """One reference less on each of ``blocks`` (last first): a block nobody holds is free,
        or evictable where the prefix cache knows it."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, f"block {b} refcount went negative"
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash. Evictable blocks become free; blocks in use stay with
        their requests, whose already-computed full blocks get registered again by their
        next :meth:`mark_computed`."""
        for b in self._evictable:
            self._free.append(b)
        self._evictable.clear()
        self._cached.clear()
        self._hash = [None] * self._num_blocks
        for req in self._reqs.values():
            req.hashes.clear()

    def _req(self, req_id: str) -> _Request:
        try:
            return self._reqs[req_id]
        except KeyError:
            raise UnknownRequestError(f"request {req_id!r} holds no blocks") from None
