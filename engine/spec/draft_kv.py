"""The draft model's paged KV blocks: one table per request that grows and shrinks.

The draft keeps its own KV cache (its own layers, heads and block pool), apart from the
target's. Its needs differ from ``kv.BlockManager``'s: no prefix cache (a draft's KV is cheap
to recompute and never shared), and a table must shrink when the verifier rejects drafted
positions (their blocks go back to the pool at once). Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DraftBlocks"]


class DraftBlocks:
    """Block ids of the draft model's KV cache, handed out per request id."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, req_id: str) -> list[int]:
        """The request's block table (the list itself: read, do not change); [] if none."""
        return self._tables.get(req_id, [])

    def reserve(self, req_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens; False (nothing changed) when
        the pool has too few free blocks."""
        table = self._tables.get(req_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra <= 0:
            return True
        if extra > len(self._free):
            return False
        table += [self._free.popleft() for _ in range(extra)]
        self._tables[req_id] = table
        return True

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Keep the blocks of the first ``num_tokens`` tokens; the rest go back to the pool."""
        table = self._tables.get(req_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())
        if not table:
            del self._tables[req_id]

    def free(self, req_id: str) -> None:
        """Every block of the request back to the pool (none held: nothing happens)."""
        for b in reversed(self._tables.pop(req_id, [])):
            self._free.append(b)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._tables
