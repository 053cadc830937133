"""Per-step LoRA mapping: which adapter slot each token of the flat batch uses.

Built once per step by the model runner and read by every LoRA layer. Tokens are grouped
by slot into *segments* (SGMV style) through a permutation, so one kernel launch covers all
adapters of the batch:

    sorted_token_ids[seg_starts[g] : seg_starts[g] + seg_lens[g]]   # tokens of segment g
    seg_slots[g]                                                     # their slot (>= 0)

NOTE: slot -1 means "base model only"; such tokens appear in no segment.

When every segment's tokens are consecutive rows of the batch (the model runner sorts rows by
slot on the CPU path), ``runs`` lists them on the host as (slot, first row, length, rank), and
the torch path works on row slices instead of gathers (ops/runs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LoRAMapping"]


@dataclass(frozen=True)
class LoRAMapping:
    token_slots: torch.Tensor  # (T,) int32, -1 = base
    sorted_token_ids: torch.Tensor  # (T_lora,) int32, token indices grouped by slot
    seg_slots: torch.Tensor  # (G,) int32, slot of each segment
    seg_starts: torch.Tensor  # (G,) int32, start of each segment in sorted_token_ids
    seg_lens: torch.Tensor  # (G,) int32, token count of each segment
    seg_ranks: torch.Tensor  # (G,) int32, rank of the adapter in each segment's slot
    max_seg_len: int  # host-side, sizes kernel grids
    num_tokens: int
    # host (slot, first row, length, rank) per segment when each segment is a run of
    # consecutive rows; None otherwise
    runs: tuple[tuple[int, int, int, int], ...] | None = None

    @property
    def num_segments(self) -> int:
        return int(self.seg_slots.shape[0])

    @property
    def has_lora(self) -> bool:
        return self.num_segments > 0

    @staticmethod
    def build(
        token_slots: Sequence[int],
        slot_ranks: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> LoRAMapping:
        """Group tokens by slot. ``slot_ranks[s]`` is the rank loaded in slot ``s``."""
        groups: dict[int, list[int]] = {}
        for t, slot in enumerate(token_slots):
            if slot >= 0:
                groups.setdefault(int(slot), []).append(t)
        order = sorted(groups)
        sorted_ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for slot in order:
            starts.append(len(sorted_ids))
            lens.append(len(groups[slot]))
            sorted_ids += groups[slot]
        ranks = [int(slot_ranks[s]) for s in order]
        runs = None
        if all(groups[s][-1] - groups[s][0] == len(groups[s]) - 1 for s in order):
            runs = tuple(
                (s, groups[s][0], len(groups[s]), r) for s, r in zip(order, ranks, strict=True)
            )

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return LoRAMapping(
            token_slots=i32([int(s) for s in token_slots]),
            sorted_token_ids=i32(sorted_ids),
            seg_slots=i32(order),
            seg_starts=i32(starts),
            seg_lens=i32(lens),
            seg_ranks=i32(ranks),
            max_seg_len=max(lens, default=0),
            num_tokens=len(token_slots),
            runs=runs,
        )
