"""The batched CPU attention (``paged_attention_batched``) vs ``paged_attention_reference``.

Every cache slot that holds no live token is NaN, so a path that lets a masked slot's value
through (0 * NaN) fails; the spare zero block of the runner's CPU cache is the last block.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.model.attention import (
    AttentionMetadata,
    paged_attention_batched,
    paged_attention_reference,
)

# (context lengths, new tokens per sequence): decode, equal prompt chunks, a mixed step with a
# prefix + chunk, whole prompts and single tokens, and a sequence with no new token
CASES = {
    "decode": ([1, 5, 16, 33, 64, 100], [1] * 6),
    "equal_chunks": ([64, 64, 64], [64, 64, 64]),
    "chunk_after_prefix": ([40, 48], [7, 7]),
    "mixed": ([1, 16, 40, 100, 17, 64, 30, 48], [1, 16, 7, 33, 1, 64, 0, 16]),
}


def _case(ctxs, ns, hkv, groups, d=16, bs=4, seed=0, zero_block=True):
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in ctxs]
    num_blocks = sum(need) + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = torch.zeros(len(ctxs), max(need) + 2, dtype=torch.int32)  # padded with block 0
    live = torch.zeros(num_blocks + zero_block, bs, dtype=torch.bool)
    for i, (c, nb) in enumerate(zip(ctxs, need, strict=True)):
        blocks = torch.tensor([free.pop() for _ in range(nb)])
        tables[i, :nb] = blocks.int()
        pos = torch.arange(c)
        live[blocks[pos // bs], pos % bs] = True
    shape = (num_blocks + zero_block, bs, hkv, d)
    k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    k[~live], v[~live] = float("nan"), float("nan")
    if zero_block:
        k[-1], v[-1] = 0.0, 0.0
    qsl = [0]
    for n in ns:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        block_tables=tables,
        query_start_loc=qsl,
        context_lens=ctxs,
        block_size=bs,
        is_decode=all(n == 1 for n in ns),
        zero_slot=num_blocks * bs if zero_block else None,
    )
    q = torch.randn(qsl[-1], hkv * groups, d, generator=g)
    return q, k, v, meta


@pytest.mark.parametrize("zero_block", [True, False])
@pytest.mark.parametrize("window", [None, 1, 5, 17])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_batched_matches_reference(case, groups, window, zero_block):
    ctxs, ns = CASES[case]
    q, k, v, meta = _case(ctxs, ns, 2, groups, zero_block=zero_block)
    out = paged_attention_batched(q, k, v, meta, 0.25, window)
    ref = paged_attention_reference(q, k, v, meta, 0.25, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_plan_is_built_once_per_step():
    q, k, v, meta = _case(*CASES["mixed"], 2, 2)
    paged_attention_batched(q, k, v, meta, 0.25)
    plan = meta.plans[(2, None, torch.float32)]
    paged_attention_batched(q, k, v, meta, 0.25)
    assert meta.plans[(2, None, torch.float32)] is plan
    assert len(plan) == len(set(n for n in CASES["mixed"][1] if n))  # one group per query length
