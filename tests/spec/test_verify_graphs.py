"""Which verification steps the CUDA graphs take (mixed_graphs.py's wide buckets): every
speculative step of up to ``speculative_max_running`` rows of 1 + K tokens finds a bucket,
and speculation off captures none. The replays themselves run on a GPU:
test_engine_draft.py's GPU test checks their tokens against PEFT and that verify steps were
graph replays."""

from __future__ import annotations

import pytest

from loraplex.engine.mixed_graphs import MIXED_QMAX, _wide_buckets

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
