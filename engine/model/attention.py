"""Attention over a paged KV cache: metadata, cache writes and the torch reference path.

KV cache of one layer: ``k_cache, v_cache`` of shape (num_blocks, block_size, Hkv, D).
A token's cache slot is ``block_id * block_size + offset``. Sequence ``i`` of the flat batch
owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` and, after this step, holds
``context_lens[i]`` tokens of KV in the blocks ``block_tables[i]``; its new tokens are the last
ones, so query row ``j`` sits at position ``context_lens[i] - n_i + j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionMetadata",
    "write_kv",
    "paged_attention_reference",
    "paged_attention_batched",
]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64, cache slot of every new token
    block_tables: torch.Tensor  # (B, max_blocks) int32, padded with 0
    query_start_loc: list[int]  # (B+1,) host
    context_lens: list[int]  # (B,) host
    block_size: int
    is_decode: bool = False  # every sequence has exactly one new token
    # device copies for the GPU kernels (None: built from the host lists when needed)
    query_start_loc_t: torch.Tensor | None = None  # (B+1,) int32
    context_lens_t: torch.Tensor | None = None  # (B,) int32
    max_query_len: int | None = None
    # a cache slot that always holds zeros (the runner keeps a spare block on the CPU path):
    # the batched path gathers it for key positions past a sequence's length
    zero_slot: int | None = None
    # per-step plans of the batched CPU path, keyed by (query heads per KV head, window, dtype)
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Scatter new keys/values (T, Hkv, D) into the paged cache."""
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, slots, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slots, v)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q (T, H, D) against the cache; returns (T, H, D).

    Semantics:
        for each sequence i, query row j at position p = ctx_i - n_i + j:
            out[row] = softmax(q[row] · K[key] * scale for key in allowed(p)) @ V
        allowed(p) = keys 0..p (and > p - sliding_window when a window is set)
    """
    out = torch.empty_like(q)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    groups = q.shape[1] // hkv
    bs = meta.block_size
    for i, ctx in enumerate(meta.context_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        n = end - start
        if n == 0:
            continue
        nblocks = (ctx + bs - 1) // bs
        blocks = meta.block_tables[i, :nblocks].long()
        keys = k_cache[blocks].reshape(-1, hkv, d)[:ctx]  # (ctx, Hkv, D)
        vals = v_cache[blocks].reshape(-1, hkv, d)[:ctx]
        qi = q[start:end].transpose(0, 1)  # (H, n, D)
        ki = keys.transpose(0, 1).repeat_interleave(groups, dim=0)  # (H, ctx, D)
        vi = vals.transpose(0, 1).repeat_interleave(groups, dim=0)
        qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)  # (n, 1)
        kpos = torch.arange(ctx, device=q.device).unsqueeze(0)  # (1, ctx)
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


@dataclass(frozen=True)
class _Group:
    """Sequences with one query length ``n``, attended as one padded batch of G sequences."""

    n: int
    rows: torch.Tensor | None  # (G*n,) their query rows; None: every row of q, in order
    mask: torch.Tensor  # (G, 1, groups*n, W) additive: 0 attend, -inf not; W = nb * block_size
    # with meta.zero_slot: (G*W,) int64 cache slots, the zero slot past each sequence's length;
    # else (G*nb,) int64 block ids (padded with 0) and ``dead``, (G, W, 1, 1) bool: key slot
    # holds no token of the sequence
    slots: torch.Tensor | None
    blocks: torch.Tensor | None
    dead: torch.Tensor | None


def _plan(
    meta: AttentionMetadata, groups: int, window: int | None, dtype: torch.dtype
) -> list[_Group]:
    """Group sequences by query length; per group: gather indices and masks (once per step)."""
    key = (groups, window, dtype)
    plan = meta.plans.get(key)
    if plan is not None:
        return plan
    qsl, bs = meta.query_start_loc, meta.block_size
    by_n: dict[int, list[int]] = {}
    for i in range(meta.num_seqs):
        n = qsl[i + 1] - qsl[i]
        if n > 0:
            by_n.setdefault(n, []).append(i)
    plan = []
    tables = meta.block_tables.long()
    for n, seqs in by_n.items():
        ctx = torch.tensor([meta.context_lens[i] for i in seqs])  # (G,)
        nb = -(-int(ctx.max()) // bs)
        kpos = torch.arange(nb * bs)  # (W,)
        qpos = (ctx - n).unsqueeze(1) + torch.arange(n)  # (G, n)
        mask = kpos <= qpos.unsqueeze(2)  # (G, n, W); kpos <= qpos < ctx
        if window is not None:
            mask &= kpos > qpos.unsqueeze(2) - window
        mask = mask.unsqueeze(1).expand(-1, groups, -1, -1).reshape(len(seqs), 1, -1, nb * bs)
        # NOTE: an additive mask, the faster one for the CPU kernel (about 2x a boolean one)
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        dead = (kpos >= ctx.unsqueeze(1)).view(len(seqs), -1, 1, 1)
        rows = None
        if len(seqs) != meta.num_seqs or len(by_n) > 1:
            rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in seqs])
        idx = torch.tensor(seqs) if len(seqs) != meta.num_seqs else slice(None)
        blocks = tables[idx, :nb].cpu()  # (G, nb)
        slots = None
        if meta.zero_slot is not None:
            slots = (blocks.unsqueeze(2) * bs + torch.arange(bs)).view(len(seqs), -1)
            slots = slots.masked_fill_(dead.view(len(seqs), -1), meta.zero_slot).view(-1)
        if slots is not None:
            parts = (rows, mask, slots, None, None)
        else:
            parts = (rows, mask, None, blocks.reshape(-1), dead)
        dev = meta.block_tables.device
        plan.append(_Group(n, *(None if x is None else x.to(dev) for x in parts)))
    meta.plans[key] = plan
    return plan


def paged_attention_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``paged_attention_reference`` without a loop per sequence (the CPU path).

    Sequences with equal query counts (every decode step, equal prompt chunks) form one padded
    batch: their blocks are gathered with one ``index_select`` per cache, the masks are built
    once per step (``meta.plans``), and the query heads that share a KV head are laid out as
    extra query rows of that head (no ``repeat_interleave`` of K and V). Cache slots past a
    sequence's length are masked out, and their values must not reach the output (a stale NaN
    times a zero weight is NaN): with ``meta.zero_slot`` that slot is gathered in their place,
    else the gathered keys and values are zeroed there.
    """
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    t, h, _ = q.shape
    groups = h // hkv
    out = None
    for g in _plan(meta, groups, sliding_window, q.dtype):
        qg = q if g.rows is None else q.index_select(0, g.rows)
        nseq = qg.shape[0] // g.n
        # (G*n, H, D) -> (G, Hkv, groups*n, D); head h = kv head * groups + j
        qg = qg.view(nseq, g.n, hkv, groups, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(nseq, hkv, groups * g.n, d)
        if g.slots is not None:
            k = k_cache.view(-1, hkv, d).index_select(0, g.slots).view(nseq, -1, hkv, d)
            v = v_cache.view(-1, hkv, d).index_select(0, g.slots).view(nseq, -1, hkv, d)
        else:
            assert g.blocks is not None and g.dead is not None
            # (G, W, Hkv, D); NOTE: keys too, an additive mask keeps a NaN score NaN
            k = k_cache.index_select(0, g.blocks).view(nseq, -1, hkv, d).masked_fill_(g.dead, 0)
            v = v_cache.index_select(0, g.blocks).view(nseq, -1, hkv, d).masked_fill_(g.dead, 0)
        o = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=g.mask, scale=scale
        )  # (G, Hkv, groups*n, D)
        o = o.view(nseq, hkv, groups, g.n, d).permute(0, 3, 1, 2, 4).reshape(-1, h, d)
        if g.rows is None:
            return o
        if out is None:
            out = torch.zeros_like(q)
        out.index_copy_(0, g.rows, o)
    return out if out is not None else torch.zeros_like(q)
