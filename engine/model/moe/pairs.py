"""Routing and the expert sort for a step: the Triton kernels (moe/triton_routing.py) where
asked for and where they apply, else their torch twins (moe/routing.py). A module of its own so
that the kernels' module can import the twins' without a cycle."""

from __future__ import annotations

import torch

from loraplex.engine.model.moe.routing import ExpertBlocks, route, sort_by_expert

__all__ = ["route_pairs", "sort_pairs"]


def route_pairs(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, fp32_weights: bool, triton: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route``; ``triton``: in one launch (moe/triton_routing.py; of equal probabilities the
    lower expert id first, where ``torch.topk``'s order is unspecified)."""
    if not triton:
        return route(logits, top_k, renormalize=renormalize, fp32_weights=fp32_weights)
    from loraplex.engine.model.moe.triton_routing import route_triton

    return route_triton(logits, top_k, renormalize=renormalize, fp32_weights=fp32_weights)


def sort_pairs(
    experts: torch.Tensor, num_experts: int, block_m: int, *, triton: bool
) -> ExpertBlocks:
    """``sort_by_expert``; ``triton``: in one launch where the step's pairs fit one program
    (moe/triton_routing.py), the same tensors."""
    if triton:
        from loraplex.engine.model.moe.triton_routing import (
            MAX_SORT_PAIRS,
            sort_by_expert_triton,
        )

        if 0 < experts.numel() <= MAX_SORT_PAIRS:
            return sort_by_expert_triton(experts, num_experts, block_m)
    return sort_by_expert(experts, num_experts, block_m)
