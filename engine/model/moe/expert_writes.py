"""A slot write's expert half in one launch: the packed image's expert blocks scattered into a
slot's ``ExpertLoRA`` regions of every sparse layer (``expert_lora.py``).

Per module, ``ExpertLoRA.set`` copies each expert's A and B^T apart: a per-expert adapter at the
Qwen3-30B-A3B shape (48 layers, 128 experts, gate / up / down) is ~37 000 small copies a write.
Here the copies of a packed layout are one scatter plan (``lora/ops/scatter.py``), made once per
layout from slot 0's views, and a write is ``clear`` (a memset per buffer of a slot that held
experts) then one launch with the slot index. Every destination is a run of contiguous rows:

    per-expert gate / up:  A (r, H) -> a_gate_up[s, e, half*R : half*R + r]       contiguous
                           B^T (r, I) -> b_gate_up[s, e, :r, half*I : (half+1)*I]  rows of 2I
    per-expert down:       A (r, I) -> a_down[s, e, :r]; B^T (r, H) -> b_down[s, e, :r]
    fused (E experts):     A rows e*r .. (e+1)*r -> a_*[s, e, :r] (gate_up: both halves), one
                           view an expert; B^T rows j*E .. (j+1)*E (rank row j of every expert,
                           PEFT's column order) -> b_*[s, :, j] (E, out), one view a rank row

The twin is ``write_experts_per_module``, ``ExpertLoRA.set`` per module (``SlotBuffers.write(
scatter="torch")``): the tests compare the slot bytes both leave.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loraplex.engine.model.lora.ops.scatter import ScatterPlan, build_plan, scatter_triton
from loraplex.engine.model.lora.slot_image import PackedAdapter, PackEntry
from loraplex.engine.model.moe.expert_lora import ExpertLoRA
from loraplex.engine.model.moe.lora_names import expert_module

__all__ = [
    "ExpertPlan",
    "expert_entries",
    "expert_plan",
    "write_experts_batched",
    "write_experts_per_module",
]

Copy = tuple[torch.Tensor, int, int]  # (destination view in slot 0, its slot stride, source)


def expert_entries(packed: PackedAdapter) -> list[tuple[tuple[int, str], PackEntry]]:
    """The packed image's expert modules, in its order."""
    return [(k, e) for k, e in packed.entries.items() if expert_module(k[1]) is not None]


def _copies(block: ExpertLoRA, module: str, e: PackEntry) -> list[Copy]:
    em = expert_module(module)
    assert em is not None
    big_r, i, r = block.max_rank, block.width, e.rank
    if em.role in ("gate", "up", "gate_up"):
        a, b = block.a_gate_up, block.b_gate_up
    else:
        a, b = block.a_down, block.b_down
    sa, sb = a.stride(0), b.stride(0)
    if em.expert is not None:
        x = em.expert
        if em.role == "down":
            return [(a[0, x, :r], sa, e.a_offset), (b[0, x, :r], sb, e.b_offset)]
        half = 0 if em.role == "gate" else 1
        return [
            (a[0, x, half * big_r : half * big_r + r], sa, e.a_offset),
            (b[0, x, :r, half * i : (half + 1) * i], sb, e.b_offset),
        ]
    n_exp, d_in, d_out = e.experts, e.in_features, e.out_features
    halves = (0, big_r) if em.role == "gate_up" else (0,)
    out = [
        (a[0, x, lo : lo + r], sa, e.a_offset + x * r * d_in) for x in range(n_exp) for lo in halves
    ]
    out += [(b[0, :, j], sb, e.b_offset + j * n_exp * d_out) for j in range(r)]
    return out


class ExpertPlan:
    """One packed layout's expert scatter (``plan``, None without expert modules) and the
    largest expert rank it writes into each sparse block."""

    def __init__(self, plan: ScatterPlan | None, ranks: dict[int, int]) -> None:
        self.plan = plan
        self.ranks = ranks


def expert_plan(blocks: Mapping[int, ExpertLoRA], packed: PackedAdapter) -> ExpertPlan:
    """``packed``'s expert copies as one scatter plan over ``blocks`` (layer -> its slots).
    Typed ``ValueError`` for an expert module of a layer without expert slots."""
    copies: list[Copy] = []
    ranks: dict[int, int] = {}
    for (layer, module), e in expert_entries(packed):
        block = blocks.get(layer)
        if block is None:
            raise ValueError(f"the packed adapter has experts for layer {layer}, a dense one")
        copies += _copies(block, module, e)
        ranks[layer] = max(ranks.get(layer, 0), e.rank)
    if not copies:
        return ExpertPlan(None, ranks)
    bufs = [
        t for blk in blocks.values() for t in (blk.a_gate_up, blk.b_gate_up, blk.a_down, blk.b_down)
    ]
    base = min(bufs, key=lambda t: t.data_ptr())
    return ExpertPlan(build_plan(copies, [], base), ranks)


def write_experts_batched(
    blocks: Mapping[int, ExpertLoRA], slot: int, plan: ExpertPlan, src: torch.Tensor | None
) -> None:
    """``slot``'s expert LoRA from the staged image ``src``: cleared where it may hold an
    earlier adapter's, then ``plan``'s one scatter; each block's ``ranks`` follow."""
    for block in blocks.values():
        block.clear(slot)
    if plan.plan is None:
        return
    _check_slot(blocks, slot)
    if src is None:
        raise ValueError("expert modules need the packed buffer on the device")
    scatter_triton(src, plan.plan, slot)
    for layer, rank in plan.ranks.items():
        blocks[layer].written(slot, rank)


def write_experts_per_module(
    blocks: Mapping[int, ExpertLoRA], slot: int, packed: PackedAdapter, src: torch.Tensor | None
) -> None:
    """The twin of ``write_experts_batched``: ``ExpertLoRA.set`` per module (a copy per expert
    and block of A and of B^T)."""
    experts = expert_entries(packed)
    for block in blocks.values():
        block.clear(slot)
    if not experts:
        return
    _check_slot(blocks, slot)
    if src is None:
        raise ValueError("expert modules need the packed buffer on the device")
    for (layer, module), e in experts:
        block = blocks.get(layer)
        if block is None:
            raise ValueError(f"the packed adapter has experts for layer {layer}, a dense one")
        em = expert_module(module)
        assert em is not None
        block.set(slot, em.role, em.expert, packed_view(src, e, "a"), packed_view(src, e, "b"))


def _check_slot(blocks: Mapping[int, ExpertLoRA], slot: int) -> None:
    """A write of expert modules goes only to an expert-capable slot (the slot store hands
    adapters with experts no other): typed ``ValueError``, never a write past the buffers."""
    for block in blocks.values():
        if not block.holds(slot):
            raise ValueError(
                f"LoRA slot {slot} holds no expert storage: an adapter with LoRA on the experts "
                f"needs one of the {block.max_loras} expert-capable slots (max_expert_loras)"
            )


def packed_view(src: torch.Tensor, e: PackEntry, which: str) -> torch.Tensor:
    """``e``'s A (rows, in) or B (out, rows) in the staged image ``src``."""
    if which == "a":
        return src[e.a_offset : e.a_offset + e.rows * e.in_features].view(e.rows, e.in_features)
    n = e.rows * e.out_features
    return src[e.b_offset : e.b_offset + n].view(e.rows, e.out_features).t()
