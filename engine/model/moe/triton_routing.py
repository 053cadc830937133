"""Triton: a step's routing in two launches instead of ~27 small torch ops.

A decode step of a MoE model is launch-bound at small batches: each sparse layer ran softmax,
top-k, the renormalisation and the cast (5 launches), then ``routing.sort_by_expert``'s
histogram, prefix sums, stable argsort and scatters (~22 launches): at a few microseconds a
launch in a CUDA graph, more than the experts' weight read of one token.

``route_triton``: grid (T,), one program per token: float32 softmax over the E router logits,
the top k by k rounds of argmax (the largest first, as ``torch.topk``; of equal values the
lower expert id), renormalised, cast. Twin: ``routing.route``.

``sort_by_expert_triton``: one program for the whole step: the expert of each of the P pairs,
a histogram, prefix sums of the counts padded to ``block_m``, a stable sort of (expert, pair)
keys, each pair scattered to its padded place, the owner of every block. Twin:
``routing.sort_by_expert`` (the same tensors, bit for bit). One program holds every pair in
registers: steps of up to ``MAX_SORT_PAIRS`` pairs (decode and the mixed graphs' buckets); a
larger step (a long prefill, where launches are cheap against its GEMMs) uses the twin. One
compiled variant per power of two of P (and block size): start-up's eager warm-up
(warmup.py) and the graph captures meet them all before serving.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.engine.model.moe.routing import ExpertBlocks, max_blocks

__all__ = ["MAX_SORT_PAIRS", "route_triton", "sort_by_expert_triton"]

MAX_SORT_PAIRS = 4096  # 256 tokens x top 16, or 512 x 8: one program's registers


@triton.jit
def _route_kernel(
    logits_ptr, w_ptr, e_ptr, stride_l, E,
    E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    ok = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    num = tl.where(ok, tl.exp(x), 0.0)
    probs = num / tl.sum(num, axis=0)
    probs = tl.where(ok, probs, -1.0)  # (below any probability: never chosen)
    ks = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    chosen = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(probs, axis=0)
        idx = tl.min(tl.where(probs == best, offs, E_PAD), axis=0)  # the lowest id of the max
        weights = tl.where(ks == j, best, weights)
        chosen = tl.where(ks == j, idx.to(tl.int64), chosen)
        probs = tl.where(offs == idx, -1.0, probs)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    kk = ks < K
    tl.store(w_ptr + t * K + ks, weights.to(w_ptr.dtype.element_ty), mask=kk)
    tl.store(e_ptr + t * K + ks, chosen, mask=kk)


def route_triton(
    logits: torch.Tensor, top_k: int, *, renormalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.route`` in one launch: (T, E) logits -> weights (T, k), experts (T, k) int64."""
    t, e = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    wdt = torch.float32 if fp32_weights else logits.dtype
    weights = torch.empty(t, top_k, dtype=wdt, device=logits.device)
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, weights, experts, logits.stride(0), e,
            E_PAD=triton.next_power_of_2(e), K=top_k, K_PAD=triton.next_power_of_2(top_k),
            RENORM=renormalize, num_warps=4,
        )  # fmt: skip
    return weights, experts


@triton.jit(do_not_specialize=["P", "E", "NB"])  # (one variant per P_PAD, not per P)
def _sort_kernel(
    e_ptr, pairs_ptr, owner_ptr, shift_ptr, P, E, NB,
    BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    FILL: tl.constexpr, OWN: tl.constexpr,
):  # fmt: skip
    s = tl.arange(0, P_PAD)
    live = s < P
    ex = tl.load(e_ptr + s, mask=live, other=0).to(tl.int32)
    ex = tl.where(live, ex, E)  # padding entries: a spare bin past the last expert
    counts = tl.histogram(ex, E_PAD)  # (E_PAD,); bin E counts the padding
    eo = tl.arange(0, E_PAD)
    counts = tl.where(eo < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    first = tl.cumsum(counts, axis=0) - counts
    tl.store(shift_ptr + eo, starts - first)  # where each expert's sorted run moves to
    # stable order: by expert, then by pair (keys of padding entries sort last)
    key = tl.where(live, ex * P_PAD + s, E_PAD * P_PAD)
    key = tl.sort(key)
    se = key // P_PAD
    si = key % P_PAD
    for off in range(0, NB * BLOCK_M, FILL):  # every entry starts as padding (pair P)
        f = off + tl.arange(0, FILL)
        tl.store(pairs_ptr + f, tl.full((FILL,), 0, tl.int32) + P, mask=f < NB * BLOCK_M)
    tl.debug_barrier()  # (the shifts and the padding are written before they are read over)
    shift = tl.load(shift_ptr + se, mask=live, other=0)
    tl.store(pairs_ptr + s + shift, si, mask=live)
    # the owner of each block: the experts whose padded run ends at or before its start
    for b0 in range(0, NB_PAD, OWN):
        b = b0 + tl.arange(0, OWN)
        done = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (eo < E)[None, :]
        owner = tl.sum(done.to(tl.int32), axis=1)
        owner = tl.where(owner < E, owner, -1)
        tl.store(owner_ptr + b, owner, mask=b < NB)


def sort_by_expert_triton(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """``routing.sort_by_expert`` in one launch (``MAX_SORT_PAIRS`` pairs at most)."""
    flat = experts.reshape(-1)
    p = int(flat.shape[0])
    if not 0 < p <= MAX_SORT_PAIRS:
        raise ValueError(f"{p} pairs: the one-program sort takes 1..{MAX_SORT_PAIRS}")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    dev = flat.device
    nb = max_blocks(p, num_experts, block_m)
    e_pad = triton.next_power_of_2(num_experts + 1)  # (+1: the padding entries' bin)
    pairs = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    owner = torch.empty(nb, dtype=torch.int32, device=dev)
    shift = torch.empty(e_pad, dtype=torch.int32, device=dev)
    p_pad = max(triton.next_power_of_2(p), 16)
    _sort_kernel[(1,)](
        flat, pairs, owner, shift, p, num_experts, nb,
        BLOCK_M=block_m, P_PAD=p_pad, E_PAD=e_pad, NB_PAD=triton.next_power_of_2(nb),
        FILL=1024, OWN=max(1, min(64, 8192 // e_pad)), num_warps=8 if p_pad >= 1024 else 4,
    )  # fmt: skip
    return ExpertBlocks(pairs, owner, block_m, p)
