"""The prompt-lookup proposer: longest suffix first, most recent occurrence, at most k."""

from __future__ import annotations

import random

import pytest

from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.spec.ngram import NgramProposer, lookup


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: a 3-gram at 0..2 (followed by 7, 8), a later 1-gram 3 followed by 9
    seq = [1, 2, 3, 7, 8, 5, 3, 9, 4, 1, 2, 3]
    assert lookup(seq, 2) == [7, 8]
    assert lookup(seq, 5) == [7, 8, 5, 3, 9]


def test_most_recent_of_equal_length_and_k_bound():
    seq = [5, 6, 1, 5, 6, 2, 5, 6]
    assert lookup(seq, 1) == [2]  # [5, 6] at 3..4 is more recent than at 0..1
    assert lookup(seq, 3) == [2, 5, 6]
    assert lookup(seq, 0) == []


def test_min_n_and_no_match():
    seq = [1, 2, 3, 4, 9, 4]
    assert lookup(seq, 3) == [9, 4]  # the 1-gram [4]
    assert lookup(seq, 3, min_n=2) == []
    assert lookup([1, 2, 3], 3) == []
    assert lookup([7], 3) == []


def test_max_n_caps_the_match_and_proposal_may_run_into_the_suffix():
    seq = [1, 2, 1, 2, 1, 2]
    # the most recent occurrence of [1, 2] ends at 3: what followed is [1, 2] (the suffix)
    assert lookup(seq, 4, max_n=2) == [1, 2]
    assert lookup(seq, 4, max_n=4) == [1, 2]  # [1, 2, 1, 2] at 0..3


def test_proposer_reads_prompt_and_output():
    req = Request("r", [10, 11, 12, 13, 14], SamplingParams())
    req.output_ids += [20, 10, 11]
    prop = NgramProposer()
    (p,) = prop.propose([req], 3)
    assert p.tokens == [12, 13, 14] and p.probs is None
    req.output_ids.append(99)
    assert prop.propose([req], 3)[0].tokens == []
    prop.commit(req, 0)
    prop.release(req)


def test_bad_sizes():
    with pytest.raises(ValueError):
        NgramProposer(max_n=2, min_n=3)
    with pytest.raises(ValueError):
        NgramProposer(min_n=0)


def test_proposer_min_n():
    """``min_n`` 2: a 1-token match is no proposal (the default, 1, proposes from it)."""
    req = Request("r", [4, 9, 5, 6, 7], SamplingParams())
    req.output_ids += [8, 4]  # the last token 4 occurred before, [8, 4] did not
    assert NgramProposer(min_n=2).propose([req], 3)[0].tokens == []
    assert NgramProposer().propose([req], 3)[0].tokens == [9, 5, 6]
    req.output_ids += [9]  # [4, 9] did
    assert NgramProposer(min_n=2).propose([req], 3)[0].tokens == [5, 6, 7]


@pytest.mark.parametrize("seed", range(16))
def test_proposer_index_matches_lookup_as_a_request_grows(seed: int):
    """The proposer's per-request index of token positions proposes what ``lookup`` (one scan
    of the whole context) does, step after step as accepted tokens join; a request whose
    tokens are not an extension of what was indexed is indexed again; release drops it."""
    g = random.Random(seed)
    vocab = g.choice([3, 12, 200])
    max_n = g.choice([1, 2, 3, 4])
    prop = NgramProposer(max_n=max_n, min_n=g.randint(1, max_n))
    reqs = [
        Request(f"r{i}", [g.randrange(vocab) for _ in range(g.randint(1, 40))], SamplingParams())
        for i in range(3)
    ]
    for _ in range(60):
        k = g.randint(0, 5)
        got = prop.propose(reqs, k)
        for r, p in zip(reqs, got, strict=True):
            assert p.tokens == lookup(r.tokens, k, prop.max_n, prop.min_n)
            r.output_ids += [g.randrange(vocab) for _ in range(g.randint(0, 3))]
        if g.random() < 0.1:  # a history that changed (not only grew)
            r = g.choice(reqs)
            r.prompt_ids = [g.randrange(vocab) for _ in range(len(r.prompt_ids))]
    assert len(prop._index) == 3
    for r in reqs:
        prop.release(r)
    assert len(prop._index) == 0
