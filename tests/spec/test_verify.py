"""Rejection sampling (spec/verify.py) through the sampler's own transforms: greedy rows keep
the argmax prefix; sampled tokens follow the target distribution, with a point-mass proposal
and with a proposal distribution, under temperature / top-k / top-p, min_tokens bans and a
structured-output mask (chi-square over many rows of synthetic logits)."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.engine.sampler import Sampler, make_generator
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.spec.verify import VerifyRow, verify
from loraplex.engine.structured.bitmask import mask_words
from tests.helpers.stats import chi2_limit

V = 8


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom of observed ``counts`` against ``probs``; a count
    where the probability is 0 is an outright failure."""
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0, (counts, probs)
    exp = probs[support] * n
    stat = ((counts[support] - exp) ** 2 / exp).sum().item()
    return stat, int(support.sum()) - 1


def target(sampler: Sampler, logits: torch.Tensor, params, banned=None, masks=None):
    return sampler.probs(sampler.restrict(logits.clone(), banned, masks), params)


def test_greedy_keeps_the_argmax_prefix_and_adds_the_next_argmax():
    logits = torch.tensor([[0, 5, 0, 0], [0, 0, 5, 0], [0, 0, 0, 5], [5, 0, 0, 0], [1, 0, 0, 0.0]])
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    rows = [VerifyRow(greedy, None, [1, 2, 0]), VerifyRow(greedy, None, [])]
    out = verify(Sampler(), logits, rows).fetch()
    # proposal 1, 2 kept (argmax of positions 0, 1); 0 rejected (argmax 3) -> corrected
    assert out.tokens == [[1, 2, 3], [0]]
    assert out.accepted == [2, 0]
    raw = torch.log_softmax(logits, -1)
    assert math.isclose(out.logprobs[0][2], raw[2, 3].item(), rel_tol=1e-6)
    assert out.top_logprobs[0][0][0][0] == 1
    out = verify(Sampler(), logits[:4], [VerifyRow(greedy, None, [1, 2, 3])]).fetch()
    assert out.tokens == [[1, 2, 3, 0]]  # all kept: the bonus is position 3's argmax
    assert out.accepted == [3]


def _rows(n, params, draft):
    return [VerifyRow(params, None, list(draft)) for _ in range(n)]


def _check(tokens: list[list[int]], p: torch.Tensor, draft_of) -> None:
    """First tokens follow p[0]; the token after an accepted d_1 follows p[1]."""
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).double()
    stat, df = chi2(first, p[0].double())
    assert stat < chi2_limit(df), (stat, df)
    second = [t[1] for i, t in enumerate(tokens) if len(t) > 1 and t[0] == draft_of(i)[0]]
    assert len(second) > 500
    counts = torch.bincount(torch.tensor(second), minlength=V).double()
    stat, df = chi2(counts, p[1].double())
    assert stat < chi2_limit(df), (stat, df)


def test_point_mass_proposal_is_exact_under_every_transform():
    torch.manual_seed(0)
    n = 6000
    base = torch.randn(3, V) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_tokens=1)
    sampler = Sampler(seed=3)
    # min_tokens 1 with nothing generated: position 0 bans EOS (id 7); position 1 is free
    ban = [[7], [], []]
    # a structured-output mask on position 1: tokens 0..5 only
    allow = torch.zeros(mask_words(V), dtype=torch.int32)
    allow[0] = 0b111111
    p = target(sampler, base, [params] * 3, ban, (allow.view(1, -1), torch.tensor([1])))
    draft = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely and a less likely token
    logits = base.repeat(n, 1)
    rows = _rows(n, params, draft)
    for r in rows:
        r.banned = ban
    masks = (allow.view(1, -1).repeat(n, 1), torch.arange(n) * 3 + 1)
    out = verify(sampler, logits, rows, masks).fetch()
    _check(out.tokens, p, lambda i: draft)
    # and the plain sampler at position 0 draws the same distribution (no speculation)
    plain = sampler.sample(base[:1].repeat(n, 1), [params] * n, None, [[7]] * n).token_ids
    both = torch.stack(
        [torch.bincount(torch.tensor(x), minlength=V) for x in (plain, [t[0] for t in out.tokens])]
    ).double()
    col = both.sum(0)
    keep = col > 0
    exp = both.sum(1, keepdim=True) * col / both.sum()
    stat = ((both - exp) ** 2 / exp)[:, keep].sum().item()
    assert stat < chi2_limit(int(keep.sum()) - 1), stat


def test_proposal_distribution_is_exact_with_seeded_rows():
    torch.manual_seed(1)
    n = 5000
    base = torch.randn(3, V)
    params = SamplingParams(temperature=1.2, seed=5)
    sampler = Sampler(seed=9)
    p = target(sampler, base, [params] * 3)
    q = torch.softmax(torch.randn(2, V), -1)  # a draft model's (different) distribution
    gen = torch.Generator().manual_seed(11)
    drafts = [[int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)] for _ in range(n)]
    rows = [VerifyRow(params, make_generator(500 + i), drafts[i], q) for i in range(n)]
    out = verify(sampler, base.repeat(n, 1), rows).fetch()
    _check(out.tokens, p, lambda i: drafts[i])
    # acceptance happens at the theoretical rate sum_x min(p, q) at position 0
    rate = sum(a > 0 for a in out.accepted) / n
    assert abs(rate - torch.minimum(p[0], q[0]).sum().item()) < 0.03


def test_seeded_row_without_proposal_draws_what_the_sampler_draws():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(4)]
    plain = Sampler().sample(logits, params, [make_generator(s) for s in range(4)]).token_ids
    rows = [VerifyRow(params[s], make_generator(s), []) for s in range(4)]
    assert [t[0] for t in verify(Sampler(), logits, rows).fetch().tokens] == plain


def test_a_narrower_proposal_distribution_reads_zero_past_its_ids():
    """A draft model's distribution has the base vocabulary; the target's logits may be wider
    (an adapter's added tokens): the ids past the draft's have q = 0, exactly as if the draft
    had given zeros there."""
    torch.manual_seed(2)
    n = 64
    base = torch.randn(2, V + 3)  # 3 added ids
    params = SamplingParams(temperature=1.0, seed=1)
    q = torch.softmax(torch.randn(1, V), -1)
    padded = torch.cat([q, torch.zeros(1, 3)], dim=1)
    outs = []
    for probs in (q, padded):
        rows = [VerifyRow(params, make_generator(i), [i % V], probs) for i in range(n)]
        outs.append(verify(Sampler(), base.repeat(n, 1), rows).fetch())
    assert outs[0].tokens == outs[1].tokens and outs[0].accepted == outs[1].accepted
    too_wide = [VerifyRow(params, None, [0], torch.softmax(torch.randn(1, V + 4), -1))]
    with pytest.raises(ValueError, match="logits"):
        verify(Sampler(), base, too_wide)


def test_plain_greedy_rows_take_the_argmax_path_with_the_general_paths_tokens():
    """Greedy rows without logprobs, bans or masks are verified from the argmax alone
    (``PendingGreedy``): the same tokens and kept counts as the general path, which a row
    asking for logprobs takes; a ban or a mask sends the step back to the general path."""
    from loraplex.engine.spec.verify import PendingGreedy, PendingVerify

    g = torch.Generator().manual_seed(4)
    plain, with_lp = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)
    for trial in range(200):
        ks = [int(torch.randint(0, 5, (1,), generator=g)) for _ in range(3)]
        logits = torch.randn(sum(k + 1 for k in ks), V, generator=g)
        am = logits.argmax(-1).tolist()
        drafts, pos = [], 0
        for k in ks:  # a random prefix of each draft agrees with the argmax
            keep = int(torch.randint(0, k + 1, (1,), generator=g))
            d = [
                am[pos + j] if j < keep else int(torch.randint(0, V, (1,), generator=g))
                for j in range(k)
            ]
            drafts.append(d)
            pos += k + 1
        fast = verify(Sampler(), logits, [VerifyRow(plain, None, d) for d in drafts])
        slow = verify(Sampler(), logits, [VerifyRow(with_lp, None, d) for d in drafts])
        assert isinstance(fast, PendingGreedy) and isinstance(slow, PendingVerify)
        a, b = fast.fetch(), slow.fetch()
        assert (a.tokens, a.accepted) == (b.tokens, b.accepted), trial
        assert all(x is None for lp in a.logprobs for x in lp)
    banned = VerifyRow(plain, None, [1], banned=[[7], []])
    assert isinstance(verify(Sampler(), torch.randn(2, V), [banned]), PendingVerify)
