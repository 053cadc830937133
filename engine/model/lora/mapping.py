"""Per-step LoRA metadata: which adapter slot each token of the flat batch uses.

Built once per step (the model runner, or the fused forward from its token slots) and read by
every LoRA kernel: the fused epilogues (``model/kernels``) read ``token_slots`` only; the
grouped SGMV ops (``model/lora/ops``) read the *segments*, tokens grouped by slot through a
permutation, so one kernel launch covers all adapters of the batch:

    sorted_token_ids[seg_starts[g] : seg_starts[g] + seg_lens[g]]   # tokens of segment g
    seg_slots[g]                                                     # their slot (>= 0)

NOTE: slot -1 means "base model only"; such tokens appear in no segment.

When every segment's tokens are consecutive rows of the batch (the model runner sorts rows by
slot on the CPU path), ``runs`` lists them on the host as (slot, first row, length, rank), and
the torch path works on row slices instead of gathers (ops/runs.py).

``triton`` says which implementation every kernel reading this step runs: the Triton kernel or
its torch twin (the kernel backend, ``model/backend.py``, decides it once per runner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DoraRows", "LoRAMapping"]


@dataclass(frozen=True)
class DoraRows:
    """One projection's DoRA row scales as the fused epilogues read them (model/lora/dora.py).

    A row whose slot ``on`` flags gets ``g * (y - bias) + bias`` on its base output ``y``
    (bias included), in fp32, before its LoRA delta is added; every other row (base rows,
    plain LoRA slots) is read unchanged: its ``scale`` row is never loaded."""

    scale: torch.Tensor  # (L + 1, N) g per slot; row L (index -1) ones
    on: torch.Tensor  # (L + 1,) int32: 1 where the slot holds a DoRA adapter's g here
    bias: torch.Tensor | None  # (N,) the projection's bias, or None


@dataclass(frozen=True)
class LoRAMapping:
    token_slots: torch.Tensor  # (T,) int32, -1 = base
    triton: bool = False  # kernels run as Triton (on CPU: TRITON_INTERPRET=1), else torch twins
    # SGMV segments; None when built from token slots alone (the fused path reads no segments)
    sorted_token_ids: torch.Tensor | None = None  # (T_lora,) int32, token indices by slot
    seg_slots: torch.Tensor | None = None  # (G,) int32, slot of each segment
    seg_starts: torch.Tensor | None = None  # (G,) int32, start of each segment in sorted ids
    seg_lens: torch.Tensor | None = None  # (G,) int32, token count of each segment
    seg_ranks: torch.Tensor | None = None  # (G,) int32, rank of the adapter in the segment's slot
    max_seg_len: int = 0  # host-side, sizes kernel grids
    # host (slot, first row, length, rank) per segment when each segment is a run of
    # consecutive rows; None otherwise
    runs: tuple[tuple[int, int, int, int], ...] | None = None
    # DoRA row scales: on the reference path, some token's slot holds a DoRA adapter (base
    # outputs get their slot's row scale, model/lora/dora.py); on the fused path, the epilogues read
    # each projection's ``DoraRows`` (flagged slots only: the decode graphs capture it so,
    # eager steps without DoRA rows skip it). False costs nothing
    dora: bool = False
    # fused path: the step reads A rows of ranks < rank_bound only (model/lora/ranks.py), an upper
    # bound of every row's adapter rank; None: all max_lora_rank rows
    rank_bound: int | None = None

    def rank_rows(self, max_rank: int) -> int:
        """Rank rows the fused step reads in slots of ``max_rank`` rows."""
        return max_rank if self.rank_bound is None else min(self.rank_bound, max_rank)

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    @property
    def has_segments(self) -> bool:
        return self.seg_slots is not None

    @property
    def num_segments(self) -> int:
        return 0 if self.seg_slots is None else int(self.seg_slots.shape[0])

    @property
    def has_lora(self) -> bool:
        """Some segment exists, i.e. some token uses an adapter (SGMV view of the step)."""
        return self.num_segments > 0

    @staticmethod
    def build(
        token_slots: Sequence[int],
        slot_ranks: Sequence[int],
        device: torch.device | str = "cpu",
        *,
        triton: bool = False,
        dora_slots: frozenset[int] | set[int] = frozenset(),
    ) -> LoRAMapping:
        """Group tokens by slot. ``slot_ranks[s]`` is the rank loaded in slot ``s``;
        ``dora_slots``: slots holding a DoRA adapter."""
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
            triton=triton,
            sorted_token_ids=i32(sorted_ids),
            seg_slots=i32(order),
            seg_starts=i32(starts),
            seg_lens=i32(lens),
            seg_ranks=i32(ranks),
            max_seg_len=max(lens, default=0),
            runs=runs,
            dora=bool(dora_slots) and any(s in dora_slots for s in order),
        )
