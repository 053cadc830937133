"""Which verification steps the CUDA graphs take (mixed_graphs.py's wide buckets): every
speculative step of up to ``speculative_max_running`` rows of 1 + K tokens finds a bucket,
and speculation off captures none; the host layout of a step (``_layout``) hands the graph's
LM head each item's last ``num_logits`` token rows in item order. The replays themselves run
on a GPU: test_engine_draft.py's GPU test checks their tokens against PEFT and that verify
steps were graph replays."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loraplex.engine.mixed_graphs import MIXED_QMAX, _layout, _wide_buckets
from loraplex.engine.model_runner import StepItem

SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _find(buckets, seqs, tokens):
    return next(((s, t) for s, t in buckets if s >= seqs and t > tokens), None)


@pytest.mark.parametrize("k", [1, 4, 7, 16])
@pytest.mark.parametrize("max_running", [1, 3, 8, 20])
def test_every_verify_step_has_a_bucket(k: int, max_running: int) -> None:
    buckets = _wide_buckets(SEQ_BUCKETS, k, max_running)
    assert buckets == tuple(sorted(set(buckets)))
    for seqs in range(1, max_running + 1):
        for tokens in range(seqs + 1, seqs * (k + 1) + 1):  # some row with proposals
            got = _find(buckets, seqs, tokens)
            assert got is not None, (seqs, tokens)
    assert k + 1 <= MIXED_QMAX  # a verify row fits the graphs' fixed query length
    # no bucket for sequences beyond the first seq bucket holding max_running
    top = next(s for s in SEQ_BUCKETS if s >= max_running)
    assert max(s for s, _ in buckets) == top


def test_token_budget_bounds_the_buckets() -> None:
    buckets = _wide_buckets(SEQ_BUCKETS, 16, 64, max_tokens=128)
    for s in {s for s, _ in buckets}:  # one bucket per sequence count past what it must hold
        assert sum(t > min(s * 17, 128) for b, t in buckets if b == s) == 1
    for seqs in range(1, 65):
        for tokens in range(seqs + 1, min(seqs * 17, 128) + 1):
            assert _find(buckets, seqs, tokens) is not None, (seqs, tokens)


def test_no_speculation_no_wide_buckets() -> None:
    assert _wide_buckets(SEQ_BUCKETS, 0, 8) == ()
    assert _wide_buckets(SEQ_BUCKETS, 4, 0) == ()


def _step(g: random.Random, k: int) -> list[StepItem]:
    """Verify rows (1 + up to k tokens, logits at each), decode rows, prefill chunks with and
    without logits, on random slots (-1: base)."""
    items = []
    for i in range(g.randint(2, 8)):
        kind = g.choice(["verify", "decode", "prefill", "chunk"])
        n = {"verify": 1 + g.randint(1, k), "decode": 1}.get(kind, g.randint(2, 20))
        start = g.randint(0, 60)
        ids = [1000 * (i + 1) + j for j in range(n)]  # (row i, token j): traceable
        table = list(range(10 * i, 10 * i + (start + n) // 16 + 1))
        items.append(
            StepItem(
                ids, start, table, g.randint(-1, 3), need_logits=kind != "chunk",
                num_logits=n if kind == "verify" else 1,
            )
        )  # fmt: skip
    if all(len(it.token_ids) == 1 for it in items):  # (a mixed step has some chunk)
        items[0] = StepItem([7, 8, 9], 0, [0], 0, num_logits=3)
    return items


@pytest.mark.parametrize("seed", range(20))
def test_layout_hands_each_item_its_logits_rows(seed: int) -> None:
    g = random.Random(seed)
    k = 4
    items = _step(g, k)
    tokens = sum(len(it.token_ids) for it in items)
    sb, tb, width, bs = 8, tokens + 1 + g.randint(0, 8), 12, 16
    for wide in (True, False):
        host = np.zeros(6 * tb + 4 * sb + 1 + sb * width, dtype=np.int64)
        out = _layout(items, host, sb, tb, width, bs, wide)
        tok = host[: 6 * tb].reshape(6, tb)
        ids, pos, slots = tok[0], tok[1], tok[3]
        need = [it for it in items if it.need_logits]
        if wide:  # the rows the wide graph's LM head reads, in output order
            rows = tok[5, :out]
            want = [t for it in need for t in it.token_ids[len(it.token_ids) - it.num_logits :]]
            assert out == sum(it.num_logits for it in need)
            assert (tok[5, out:] == tb - 1).all()  # the rest: a padding row
        else:
            rows = host[6 * tb + 2 * sb + 1 : 6 * tb + 3 * sb + 1][:out]
            want = [it.token_ids[-1] for it in need]
            assert out == len(need)
        assert ids[rows].tolist() == want
        # each token row keeps its position and its item's slot; padding rows have no slot
        for it in items:
            for j, t in enumerate(it.token_ids):
                (r,) = np.nonzero(ids[:tokens] == t)[0]
                assert pos[r] == it.start_pos + j and slots[r] == it.lora_slot
        assert (slots[tokens:] == -1).all()
        # the attention launches' sequences: the prefill launch's rows [qsl[k], qsl[k + 1]) are
        # a whole item (wide: every item, decode rows too, one launch), or none (a decode row,
        # whose last row, as every item's, the decode launch computes); padding sequences none
        seq = host[6 * tb : 6 * tb + 4 * sb + 1]
        qsl, ctx, seq_last = seq[: sb + 1], seq[sb + 1 : 2 * sb + 1], seq[3 * sb + 1 :]
        seen = []
        for k in range(len(items)):
            rows_k = ids[qsl[k] : qsl[k + 1]].tolist()
            (it,) = [it for it in items if it.token_ids[-1] == ids[seq_last[k]]]
            assert ctx[k] == it.start_pos + len(it.token_ids)
            if wide or len(it.token_ids) > 1:
                assert rows_k == it.token_ids
            else:
                assert rows_k == []
            seen.append(it)
        assert len({id(it) for it in seen}) == len(items)
        assert (qsl[len(items) :] == qsl[len(items)]).all() and (ctx[len(items) :] == 0).all()
