"""Lanes of independently compiled matchers (grammars.py): the masks that ``fill_masks`` fills
for rows spread over lanes are the masks of one compiled matcher's copies, computed one row
at a time (the path before lanes), along sampled paths of every test form and of the decode
benchmark's bounded-string schema."""

from __future__ import annotations

import asyncio
import json
import random
import re

import llguidance
import pytest
import torch

from benchmarks.structured import write_synthetic_tokenizer
from loraplex.engine.demo import demo_model_dir
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.bitmask import fill_masks, mask_words
from loraplex.engine.structured.grammars import GrammarCache, grammar_text
from loraplex.engine.tokenizer import Tokenizer
from tests.structured.forms import FORMS, LONG

SPECS = {
    "json_object": StructuredOutput.json_object(),
    **{n: StructuredOutput.json_schema(v) for n, (f, v) in FORMS.items() if f == "json"},
    "regex": StructuredOutput.regex(FORMS["regex"][1]),
    "choice": StructuredOutput.choice(FORMS["choice"][1]),
    "long": StructuredOutput.json_schema(LONG),
}


@pytest.fixture(scope="module", params=["demo", "synthetic"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "demo":
        return Tokenizer.from_dir(demo_model_dir())
    # byte-level BPE of JSON-ish merges up to 12 characters, as the decode benchmark's
    folder = tmp_path_factory.mktemp("synthetic")
    write_synthetic_tokenizer(folder, 4096, bos=4094, eos=4095)
    return Tokenizer.from_dir(folder)


async def _guides(cache: GrammarCache, spec: StructuredOutput, n: int) -> list:
    """``n`` live guides for ``spec``, spread over the lanes."""
    return [await cache.guide(spec) for _ in range(n)]


def _allowed(row: torch.Tensor, vocab: int) -> list[int]:
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().flatten().tolist()


@pytest.mark.parametrize("form", list(SPECS))
async def test_lane_masks_equal_one_matchers_copies(tokenizer, form):
    vocab = tokenizer.vocab_size
    eos = sorted(tokenizer.eos_token_ids)
    spec = SPECS[form]
    cache = GrammarCache(tokenizer.backend.to_str, vocab, eos, lanes=3)
    try:
        guides = await _guides(cache, spec, 6)
        assert len({g.lexer for g in guides}) == 3  # the rows are spread over three lanes
        # the path before lanes: copies of one compiled matcher, one mask at a time
        one = llguidance.LLMatcher(cache.tokenizer, grammar_text(spec), log_level=0)
        refs = [one.deep_copy() for _ in guides]
        rng = random.Random(form)
        words = mask_words(vocab)
        tokens: list[list[int]] = [[] for _ in guides]
        for _ in range(40):
            got = fill_masks(guides, vocab, eos, pin=False)
            for i, (g, ref) in enumerate(zip(guides, refs, strict=True)):
                want = torch.frombuffer(bytearray(ref.compute_bitmask()), dtype=torch.int32)
                assert torch.equal(got[i], want[:words]), (form, i, tokens[i])
                allowed = _allowed(got[i], vocab)
                free = [t for t in allowed if t not in eos] or allowed
                tok = rng.choice(free)  # a sampled path: any token the mask allows
                g.accept(tok)
                if not (ref.is_stopped() or ref.is_error()):
                    assert ref.consume_token(tok), ref.get_error()
                tokens[i].append(tok)
        for i, g in enumerate(guides):
            assert not g.failed
            if form == "long":  # maxLength holds on every sampled path
                text = tokenizer.decode(tokens[i])
                assert all(len(json.loads(s)) <= 16 for s in re.findall(r'"(?:[^"\\]|\\.)*"', text))
    finally:
        cache.close()


async def test_a_request_that_finds_every_lane_busy_gets_a_new_one_up_to_lanes():
    tok = Tokenizer.from_dir(demo_model_dir())
    cache = GrammarCache(tok.backend.to_str, tok.vocab_size, sorted(tok.eos_token_ids), lanes=2)
    spec = StructuredOutput.regex("[0-9]{4}")
    try:
        first = await cache.guide(spec)
        second = await cache.guide(spec)  # lane 1 busy: a second lane, compiled for it
        assert second.lexer != first.lexer
        assert len(cache.compile_s) == 1 and len(cache.lane_s) == 1
        lanes = cache._cache[spec.key]
        third = await cache.guide(spec)  # both busy, no third lane: the least used
        assert lanes.live == [2, 1] and third.lexer == first.lexer
        del second  # its seat is given back with the guide
        assert lanes.live == [2, 0]
        assert (await cache.guide(spec)).lexer != first.lexer
        del first, third
        assert lanes.live == [0, 0]
        assert len(lanes.matchers) == 2 and len(cache.lane_s) == 1  # never more than ``lanes``
    finally:
        cache.close()


async def test_a_burst_spreads_over_the_lanes():
    tok = Tokenizer.from_dir(demo_model_dir())
    cache = GrammarCache(tok.backend.to_str, tok.vocab_size, sorted(tok.eos_token_ids), lanes=4)
    try:
        guides = await asyncio.gather(
            *(cache.guide(StructuredOutput.regex("[a-z]{4}")) for _ in range(12))
        )
        counts = sorted(sum(g.lexer == x for g in guides) for x in {g.lexer for g in guides})
        assert counts == [3, 3, 3, 3], counts
    finally:
        cache.close()


def test_compile_times_are_bounded():
    """A long-running server sees new constraints for days: the timing lists keep the latest."""
    from loraplex.engine.structured import grammars

    cache = grammars.GrammarCache("{}", 16, [0], threads=1, lanes=1)  # tokenizer: lazy
    try:
        for i in range(grammars.TIMES_KEPT + 10):
            cache.compile_s.append(float(i))
        assert len(cache.compile_s) == grammars.TIMES_KEPT
        assert cache.compile_s[-1] == grammars.TIMES_KEPT + 9
    finally:
        cache.close()
