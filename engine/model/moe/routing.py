"""Top-k routing of tokens to experts, and the expert-sorted order the grouped GEMM reads.

``route``: HF's routers (Qwen3-MoE ``Qwen3MoeTopKRouter``, Mixtral ``MixtralTopKRouter``)::

    probs = softmax(float32(logits))                  # logits = h @ W_router.T, model dtype
    weights, experts = topk(probs, k)                 # ties: torch.topk's order, as HF
    if renormalize: weights /= sum(weights)
    if not fp32_weights: weights = round(weights)     # Qwen3: model dtype; Mixtral: float32

``sort_by_expert``: the T * k (token, choice) pairs, ``pair = token * k + j``, laid out by expert
in runs padded to a multiple of ``block_m`` so that every block of ``block_m`` entries belongs
to one expert (``ExpertBlocks``). Every shape depends on T, k, E and ``block_m`` only (no host
sync, no data-dependent size): the whole step can be captured in a CUDA graph. Blocks past the
last used one carry expert -1 and are skipped by the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertBlocks", "route", "sort_by_expert", "max_blocks"]


def route(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights (T, k), experts (T, k) int64); module docstring."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not fp32_weights:
        weights = weights.to(logits.dtype)
    return weights, experts


@dataclass(frozen=True)
class ExpertBlocks:
    """Pairs sorted by expert, padded per expert to ``block_m`` (``sort_by_expert``)."""

    pairs: torch.Tensor  # (B * block_m,) int32: pair index, or P (no pair) in padding
    experts: torch.Tensor  # (B,) int32: the expert of each block; -1: an unused block
    block_m: int
    num_pairs: int  # P = T * k

    @property
    def num_blocks(self) -> int:
        return int(self.experts.shape[0])


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of ``block_m`` entries enough for any routing of ``num_pairs`` pairs: each used
    expert pads its run by less than one block, and at most min(E, P) experts are used."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """(T, k) expert ids -> ``ExpertBlocks``. Within an expert, pairs keep their order."""
    flat = experts.reshape(-1).long()  # (P,)
    p = int(flat.shape[0])
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # (E,) end of each expert's padded run
    starts = ends - padded
    first = counts.cumsum(0) - counts  # (E,) start of each expert's run unpadded
    order = torch.argsort(flat, stable=True)  # (P,) pairs by expert
    by_expert = flat[order]
    dest = starts[by_expert] + torch.arange(p, device=dev) - first[by_expert]
    nb = max_blocks(p, num_experts, block_m)
    pairs = torch.full((nb * block_m,), p, dtype=torch.int32, device=dev)
    pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(nb, device=dev) * block_m
    owner = torch.searchsorted(ends, block_start, right=True)  # first expert ending past it
    owner = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return ExpertBlocks(pairs, owner, block_m, p)
