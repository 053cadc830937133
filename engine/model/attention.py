"""Attention over a paged KV cache: metadata, cache writes and the torch reference path.

KV cache of one layer: ``k_cache, v_cache`` of shape (num_blocks, block_size, Hkv, D).
A token's cache slot is ``block_id * block_size + offset``. Sequence ``i`` of the flat batch
owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` and, after this step, holds
``context_lens[i]`` tokens of KV in the blocks ``block_tables[i]``; its new tokens are the last
ones, so query row ``j`` sits at position ``context_lens[i] - n_i + j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["AttentionMetadata", "write_kv", "paged_attention_reference"]


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
