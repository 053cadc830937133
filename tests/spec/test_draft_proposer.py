"""The draft-model proposer (engine/spec/draft.py) on a tiny random Llama draft, on CPU:
greedy proposals are HF transformers' own greedy continuation, rollback after partial
acceptance leaves the draft where a fresh one would be, blocks are freed, and batching,
prefill chunking and unembeddable tokens behave."""

from __future__ import annotations

import inspect

import pytest
import torch

from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.spec.draft import DraftProposer, draft_kv_blocks, draft_kv_bytes_per_block
from loraplex.engine.spec.draft_kv import DraftBlocks
from loraplex.engine.spec.proposer import Proposal, Proposer
from tests.helpers.models import make_tiny_model

K = 4
FUSED_TWINS = KernelBackend(fused=True, triton=False)  # the GPU forward's structure, on CPU
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PROMPTS = [[1, 17, 33, 92, 5, 200, 41], [1, 250, 3], [1, 9, 9, 9, 9, 14, 77, 123, 66, 8, 31, 2]]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("draft") / "m", kind="llama", seed=3)


@pytest.fixture(scope="module")
def hf(draft_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()


def make(draft_dir, **kw) -> DraftProposer:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return DraftProposer(draft_dir, **kw)


def req(rid: str, prompt: list[int], output: list[int] | None = None, params=GREEDY) -> Request:
    return Request(rid, list(prompt), params, output_ids=list(output or []))


@torch.no_grad()
def hf_greedy(model, tokens: list[int], n: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation of ``tokens`` and, per position, the top-2 logit gap."""
    ids = torch.tensor([tokens])
    out, gaps = [], []
    for _ in range(n):
        logits = model(input_ids=ids).logits[0, -1]
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        out.append(int(logits.argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out, gaps


def assert_greedy(ours: list[int], ref: list[int], gaps: list[float]) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if gaps[i] < 1e-4:  # a near-tie: float order may pick either
            return
        assert a == b, f"position {i}: draft {a} != HF {b}"


def test_implements_the_proposer_protocol():
    for name in ("propose", "commit", "release"):
        ours = inspect.signature(getattr(DraftProposer, name))
        theirs = inspect.signature(getattr(Proposer, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_greedy_proposals_are_hf_greedy(draft_dir, hf):
    d = make(draft_dir)
    reqs = [req(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    props = d.propose(reqs, K)
    assert [len(p.tokens) for p in props] == [K] * len(PROMPTS)
    for p, prompt in zip(props, PROMPTS, strict=True):
        assert isinstance(p, Proposal) and p.probs is None  # greedy: point masses
        assert_greedy(p.tokens, *hf_greedy(hf, prompt, K))


@pytest.mark.parametrize("accepted", [0, 2, K])
@pytest.mark.parametrize("backend", ["torch", FUSED_TWINS], ids=["torch", "fused-twins"])
def test_rollback_after_partial_acceptance(draft_dir, hf, accepted, backend):
    d = make(draft_dir, kernel_backend=backend)
    r = req("a", PROMPTS[0], output=[44])  # 8 tokens: a rejection at once frees a block
    first = d.propose([r], K)[0].tokens
    n0 = r.num_tokens
    # the verifier keeps ``accepted`` drafted tokens and appends one of its own (not the next
    # drafted one on a rejection)
    extra = (first[accepted] + 1) % 256 if accepted < K else 7
    r.output_ids += [*first[:accepted], extra]
    d.commit(r, accepted)
    kept = n0 + min(accepted, K - 1)
    assert len(d.blocks.table("a")) == d.blocks.blocks_needed(kept)
    again = d.propose([r], K)[0].tokens
    fresh = make(draft_dir).propose([req("b", r.prompt_ids, r.output_ids)], K)[0].tokens
    assert again == fresh
    assert_greedy(again, *hf_greedy(hf, list(r.tokens), K))


def test_missed_commit_still_proposes_from_the_request(draft_dir):
    """Without ``commit`` the next proposal checks the drafted tail against the tokens."""
    d = make(draft_dir)
    r = req("a", PROMPTS[2])
    first = d.propose([r], K)[0].tokens
    r.output_ids += [(first[0] + 3) % 256, first[1], first[2]]  # the first drafted one differs
    again = d.propose([r], K)[0].tokens
    assert again == make(draft_dir).propose([req("b", r.prompt_ids, r.output_ids)], K)[0].tokens


def test_release_frees_every_block(draft_dir):
    d = make(draft_dir)
    reqs = [req(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    d.propose(reqs, K)
    assert d.blocks.num_free_blocks < d.blocks.num_blocks
    reqs[0].output_ids += [3, 4]
    d.commit(reqs[0], 1)
    for r in reqs:
        d.release(r)
    assert d.blocks.num_free_blocks == d.blocks.num_blocks
    assert not d._seqs


def test_prefill_chunks_and_mixed_k(draft_dir, hf):
    """Long catch-ups split over forwards of a few tokens; rows near the draft's length limit
    draft fewer tokens in the same batch."""
    d = make(draft_dir, max_batched_tokens=3)
    short = make(draft_dir, max_batched_tokens=3)
    short.max_len = len(PROMPTS[2]) + 2  # the third request may draft 2 tokens only
    reqs = [req(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    for prop in (d, short):
        props = prop.propose(reqs, K)
        for r, p in zip(reqs, props, strict=True):
            n = K if prop is d or r.request_id != "r2" else 2
            assert len(p.tokens) == n
            assert_greedy(p.tokens, *hf_greedy(hf, list(r.tokens), n))


def test_unembeddable_tokens_turn_the_request_off(draft_dir):
    d = make(draft_dir)
    ok, bad = req("ok", PROMPTS[0]), req("bad", PROMPTS[1])
    d.propose([ok, bad], K)
    bad.output_ids += [300]  # an adapter's added token: past the draft's vocabulary
    props = d.propose([ok, bad], K)
    assert len(props[0].tokens) == K and props[1].tokens == []
    assert "bad" not in d.blocks
    assert d.propose([bad], K)[0].tokens == []


def test_full_pool_skips_the_request_this_step(draft_dir):
    d = make(draft_dir, num_blocks=3)  # 12 tokens: the 12-token prompt + drafts do not fit
    props = d.propose([req("a", PROMPTS[2]), req("b", PROMPTS[1])], K)
    assert props[0].tokens == [] and len(props[1].tokens) == K


def test_kv_bytes_per_block_is_the_runners(draft_dir):
    d = make(draft_dir)
    assert draft_kv_bytes_per_block(d.config, d.model.dtype, 4) == (
        ModelRunner.kv_bytes_per_block(d.model, 4)
    )


def test_draft_blocks_truncate_and_free():
    b = DraftBlocks(4, 4)
    assert b.reserve("x", 9) and b.table("x") == [0, 1, 2]
    assert not b.reserve("y", 8) and "y" not in b  # one block left: nothing taken
    b.truncate("x", 5)
    assert b.table("x") == [0, 1] and b.num_free_blocks == 2
    b.truncate("x", 0)
    assert "x" not in b and b.num_free_blocks == 4
    b.free("x")  # nothing held: no error
    assert draft_kv_blocks(100, 16, 2, 4) == 7 + 2 * 2


def test_kv_cache_allocated_after_the_weights(draft_dir, hf):
    """``num_blocks=None`` (start-up: the draft's weights load before the KV budget is split):
    no proposal before ``allocate``, one allocation only, then proposals as usual."""
    d = make(draft_dir, num_blocks=None)
    assert d.runner is None
    with pytest.raises(RuntimeError, match="allocate"):
        d.propose([req("a", PROMPTS[0])], K)
    d.release(req("a", PROMPTS[0]))
    d.allocate(64)
    with pytest.raises(RuntimeError, match="allocated already"):
        d.allocate(64)
    ref, gaps = hf_greedy(hf, PROMPTS[0], K)
    assert_greedy(d.propose([req("a", PROMPTS[0])], K)[0].tokens, ref, gaps)
    assert d.blocks.num_blocks == 64
