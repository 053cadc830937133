"""Per-token stop matching and off-loop tokenization keep their exact results (issue 12,
item 2): ``stop_prefix_len`` against the plain definition, ``encode_batch`` against ``encode``;
the prompt-character bound follows the context length."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.engine.demo import demo_model_dir
from loraplex.engine.detokenizer import stop_prefix_len
from loraplex.engine.server.limits import ServerLimits
from loraplex.engine.tokenizer import Tokenizer


def _reference(text: str, stops: list[str]) -> int:
    """The definition: longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(1, min(len(stop) - 1, len(text)) + 1):
            if text.endswith(stop[:k]):
                best = max(best, k)
    return best


_ALPHABET = st.sampled_from("ab\u00e9 \n")


@settings(max_examples=400, deadline=None)
@given(
    st.text(_ALPHABET, max_size=40),
    st.lists(st.text(_ALPHABET, min_size=1, max_size=12), max_size=5),
)
def test_stop_prefix_len_matches_its_definition(text, stops):
    assert stop_prefix_len(text, stops) == _reference(text, stops)


def test_stop_prefix_len_cases():
    assert stop_prefix_len("hello wor", ["world"]) == 3
    assert stop_prefix_len("aaaa", ["aaab"]) == 3
    assert stop_prefix_len("xab", ["abab", "b"]) == 2  # "b" is no proper prefix of "b"
    assert stop_prefix_len("", ["ab"]) == 0
    assert stop_prefix_len("xa", ["ab"]) == 1
    assert stop_prefix_len("ab", ["ab"]) == 0  # a whole stop string is found, not held


def test_encode_batch_equals_encode():
    tok = Tokenizer.from_dir(demo_model_dir())
    texts = ["The quick brown fox", "", "  spaces\tand\nnewlines", "\u00e9t\u00e9 \U0001f600"]
    for special in (True, False):
        assert tok.encode_batch(texts, add_special_tokens=special) == [
            tok.encode(t, add_special_tokens=special) for t in texts
        ]


def test_prompt_chars_default_follows_the_context_length():
    assert ServerLimits().for_context(1024).max_prompt_chars == 32 * 1024
    assert ServerLimits(max_prompt_chars=5).for_context(1024).max_prompt_chars == 5
