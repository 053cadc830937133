"""The draft proposer's distributions (engine/spec/draft.py, draft_sample.py): each row is HF
transformers' softmax of the draft's logits after the request's temperature, top-k and top-p,
at the position the drafted token was drawn for; draws follow them; seeds repeat."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.request import Request
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.spec.draft import DraftProposer
from tests.helpers.models import make_tiny_model

K = 3
PROMPT = [1, 40, 2, 77, 13, 99]
ATOL = 2e-6


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "m", kind="qwen2", seed=5)


@pytest.fixture(scope="module")
def hf(draft_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()


def make(draft_dir, **kw) -> DraftProposer:
    return DraftProposer(draft_dir, num_blocks=32, block_size=4, **kw)


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax(logits / T), masked to the top-k (ties kept) and the smallest prefix of the
    sorted distribution with mass >= top_p."""
    x = logits / p.temperature
    if p.top_k > 0:
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sp, order = torch.softmax(x, -1).sort(descending=True)
        drop = (sp.cumsum(-1) - sp) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(x, -1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=5, seed=2),
        SamplingParams(temperature=0.9, top_p=0.6, seed=3),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.8),
    ],
    ids=["temperature", "top_k", "top_p", "both"],
)
def test_probs_are_hf_softmax_after_the_transforms(draft_dir, hf, params):
    d = make(draft_dir)
    prop = d.propose([Request("a", list(PROMPT), params)], K)[0]
    assert len(prop.tokens) == K
    assert prop.probs is not None and prop.probs.shape == (K, 256)
    assert prop.probs.dtype == torch.float32
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(K), rtol=0, atol=1e-5)
    for j in range(K):
        ref = reference(hf_logits(hf, PROMPT + prop.tokens[:j]), params)
        torch.testing.assert_close(prop.probs[j], ref, rtol=1e-4, atol=ATOL)
        assert ref[prop.tokens[j]] > 0  # drawn inside the support
    if params.top_k > 0:
        assert int((prop.probs > 0).sum(-1).max()) <= params.top_k


def test_mixed_batch_greedy_rows_get_point_masses(draft_dir, hf):
    d = make(draft_dir)
    sampled = SamplingParams(temperature=0.8, top_k=8, seed=4)
    greedy = SamplingParams(temperature=0.0)
    reqs = [Request("g", list(PROMPT), greedy), Request("s", [1, 5, 6], sampled)]
    g, s = d.propose(reqs, K)
    assert g.probs is None and s.probs is not None and s.probs.shape == (K, 256)
    assert g.tokens[0] == int(hf_logits(hf, PROMPT).argmax())
    for j in range(K):
        ref = reference(hf_logits(hf, [1, 5, 6] + s.tokens[:j]), sampled)
        torch.testing.assert_close(s.probs[j], ref, rtol=1e-4, atol=ATOL)


def test_seeded_requests_repeat_their_drafts(draft_dir):
    params = SamplingParams(temperature=1.5, seed=11)
    runs = [make(draft_dir).propose([Request("a", list(PROMPT), params)], 6)[0] for _ in "ab"]
    assert runs[0].tokens == runs[1].tokens
    torch.testing.assert_close(runs[0].probs, runs[1].probs)


def test_draws_follow_the_probabilities():
    """Chi-square of 40 000 draws from a fixed 6-token distribution (the sampler's exponential
    race, which the draft draws with)."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    n = 40_000
    tokens = Sampler(seed=0).race(p.expand(n, -1).contiguous(), [None] * n)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = p.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
