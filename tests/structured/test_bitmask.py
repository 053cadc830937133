"""Token bitmasks: the torch twin and the Triton kernel (interpreted on CPU) against the plain
loop of the docstring, and masks filled from real matchers."""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.engine.demo import demo_model_dir
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.bitmask import apply_bitmask_torch, fill_masks, mask_words
from loraplex.engine.structured.grammars import GrammarCache, Guide
from loraplex.engine.tokenizer import Tokenizer

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _loop(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for i in range(mask.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(mask[i, t // 32]) >> (t % 32)) & 1:
                out[rows[i], t] = float("-inf")
    return out


def _case(batch: int, vocab: int, rows: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (len(rows), mask_words(vocab)), generator=g)
    return logits, mask.to(torch.int32), torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize(
    ("batch", "vocab", "rows"), [(4, 100, [0, 2]), (3, 64, [2, 1, 0]), (5, 33, [4])]
)
def test_torch_twin_matches_the_loop(batch, vocab, rows):
    logits, mask, idx = _case(batch, vocab, rows, seed=batch * vocab)
    want = _loop(logits, mask, idx)
    apply_bitmask_torch(logits, mask, idx)
    assert torch.equal(logits, want)


@pytest.mark.parametrize(("batch", "vocab", "rows"), [(4, 100, [0, 2]), (6, 5000, [5, 0, 3])])
def test_triton_matches_the_torch_twin(batch, vocab, rows):
    from loraplex.engine.structured.triton_bitmask import apply_bitmask_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits, mask, idx = _case(batch, vocab, rows, seed=vocab)
    want = logits.clone()
    apply_bitmask_torch(want, mask, idx)
    got = logits.to(device)
    apply_bitmask_triton(got, mask.to(device), idx.to(device))
    assert torch.equal(got.cpu(), want)


def _allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(mask_row[t // 32]) >> (t % 32)) & 1}


async def test_fill_masks_follows_each_matcher():
    tok = Tokenizer.from_dir(demo_model_dir())
    vocab = tok.vocab_size
    eos = sorted(tok.eos_token_ids)
    cache = GrammarCache(tok.backend.to_str, vocab, eos)
    try:
        yes_no = await cache.guide(StructuredOutput.choice(["yes", "no"]))
        digits = await cache.guide(StructuredOutput.regex("[0-9]{2}"))
        mask = fill_masks([yes_no, digits], vocab, eos, pin=False)
        assert mask.shape == (2, mask_words(vocab))
        first = {tok.decode([t]) for t in _allowed(mask[0], vocab)}
        assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)
        assert all(tok.decode([t]).isdigit() for t in _allowed(mask[1], vocab))
        for t in tok.encode("yes", add_special_tokens=False):
            yes_no.accept(t)
        done = fill_masks([yes_no], vocab, eos, pin=False)
        assert _allowed(done[0], vocab) == set(eos)  # complete: only EOS
        yes_no.accept(tok.encode("x", add_special_tokens=False)[0])  # past the end: ignored
        assert not yes_no.failed
        broken = Guide(digits.matcher.deep_copy(), digits.spec)
        broken.matcher.consume_token(tok.encode("a", add_special_tokens=False)[0])
        assert broken.failed
        assert _allowed(fill_masks([broken], vocab, eos, pin=False)[0], vocab) == set(eos)
    finally:
        cache.close()
