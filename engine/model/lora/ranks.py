"""Rank buckets: how many rank rows of the A slots a step reads (issue: mixed ranks).

The A rows of every LoRA layer are rank-major (layers.py): the rows of ranks < r_b of every
slice and slot are one prefix of the augmented GEMM's weight. A step whose rows use adapters
of rank <= r_b reads only that prefix and its epilogues loop over r_b rank columns, so a
rank-8 adapter in a rank-64 engine costs what it costs in a rank-8 engine. Graphs are captured
per (batch bucket, rank bucket) (cuda_graph.py); the eager paths read every rank row.

    buckets(R) = (8, 16, 32, ... below R) + (R,)        e.g. 64 -> (8, 16, 32, 64); 16 -> (8, 16)
    bucket(r)  = the smallest bucket >= r (the smallest bucket for a step of base rows only)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["MIN_BUCKET", "SlotRanks", "rank_buckets", "rank_bucket", "step_rank"]

MIN_BUCKET = 8  # smaller buckets save too little to pay for their graphs


def rank_buckets(max_rank: int) -> tuple[int, ...]:
    """Rank bounds of the captured graphs for slots of ``max_rank`` rank rows."""
    if max_rank <= 0:
        return (max(max_rank, 0),)
    out = []
    b = MIN_BUCKET
    while b < max_rank:
        out.append(b)
        b *= 2
    return (*out, max_rank)


def rank_bucket(rank: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` >= ``rank`` (the largest if none is)."""
    for b in buckets:
        if b >= rank:
            return b
    return buckets[-1]


def step_rank(slots: Iterable[int], slot_ranks: Sequence[int]) -> int:
    """The largest rank among the slots a step's rows read (-1: base rows), 0 if none."""
    return max((slot_ranks[s] for s in set(slots) if s >= 0), default=0)


class SlotRanks:
    """What each GPU slot holds as a step reads it: the rank of its adapter (``ranks[slot]``,
    the LoRA mappings' and the rank bucket's) and whether it is a DoRA adapter (``dora``: the
    rows of those slots get DoRA's row scale). Made by the model runner; set when a slot write
    is planned (the adapters' slot store is its only writer), copied to tensor-parallel workers
    with every step."""

    def __init__(self, num_slots: int) -> None:
        self.ranks: list[int] = [0] * num_slots
        self.dora: set[int] = set()

    def set(self, slot: int, rank: int, dora: bool = False) -> None:
        self.ranks[slot] = rank
        if dora:
            self.dora.add(slot)
        else:
            self.dora.discard(slot)

    def load(self, ranks: Sequence[int], dora: Iterable[int]) -> None:
        """Take another runner's table as a whole (a tensor-parallel worker, each step)."""
        self.ranks[:] = ranks
        self.dora = set(dora)
