"""Incremental detokenization: streaming equals full decode, UTF-8 safety, stop strings."""

from __future__ import annotations

import pytest

from loraplex.engine.detokenizer import IncrementalDetokenizer, find_stop, stop_prefix_len
from loraplex.engine.tokenizer import Tokenizer
from tests.helpers.tokenizers import EOS_ID, make_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c \U0001f600\U0001f389\U0001f680 done",
    "\U0001f600\U0001f600 emoji first, then \u4e2d\u6587 and more \u00e9\u00e8\u00ea",
    "def f(x):\n    return x * 2\n",
]
PROMPT = "<|user|>\nSay something.\n<|assistant|>\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer(tmp_path_factory.mktemp("tok")))


def _stream(
    tok: Tokenizer, text: str, chunk: int = 1, stop: list[str] | None = None, prompt: str = PROMPT
) -> tuple[IncrementalDetokenizer, list[str], list[int]]:
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.step(ids[i : i + chunk]))
        if detok.stopped:
            break
    return detok, deltas, ids


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    detok, deltas, ids = _stream(tok, text, chunk)
    tail = detok.flush()
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert detok.output_text == text and not detok.stopped
    assert detok.num_output_tokens == len(ids)
    for delta in deltas:
        assert "\ufffd" not in delta


def test_multibyte_chars_are_never_split(tok: Tokenizer) -> None:
    text = "\U0001f600\u4f60"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2, "test needs characters spread over several tokens"
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.step([i]) for i in ids]
    assert "" in deltas  # something was held back mid-character
    assert [d for d in deltas if d] == ["\U0001f600", "\u4f60"]


def test_incomplete_char_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ab\U0001f600", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    shown = "".join(detok.step([i]) for i in ids[:-1])
    assert shown == "ab"
    assert detok.flush() == tok.decode(ids[:-1])[2:] and "\ufffd" in detok.output_text


def test_prompt_context_and_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(" hello there", add_special_tokens=False) + [EOS_ID]
    prompt_ids = tok.encode(PROMPT)
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=False)
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == " hello there</s>"
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert "".join(detok.step([i]) for i in ids) + detok.flush() == " hello there"


def test_decodes_only_a_small_window(tok: Tokenizer) -> None:
    seen: list[int] = []

    class Spy:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), tok.encode(PROMPT * 10))
    text = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert len(ids) > 200 and max(seen) <= 12


STOP_CASES = [
    # (text, stops, expected text before the stop, matched stop)
    (
        "The quick brown fox jumps over the lazy dog.",
        ["lazy dog"],
        "The quick brown fox jumps over the ",
        "lazy dog",
    ),
    (
        "Hello world! Hello there, how are you?",
        ["Hello there", "zzz"],
        "Hello world! ",
        "Hello there",
    ),
    ("one two three four", ["three", "two t"], "one ", "two t"),
    (
        "Caf\u00e9 \U0001f600 stop here \U0001f389 after",
        ["\U0001f389"],
        "Caf\u00e9 \U0001f600 stop here ",
        "\U0001f389",
    ),
    ("abcabcabd tail", ["abcabd"], "abc", "abcabd"),
    ("STOP at start", ["STOP"], "", "STOP"),
]


@pytest.mark.parametrize(("text", "stops", "before", "reason"), STOP_CASES)
@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_strings(
    tok: Tokenizer, text: str, stops: list[str], before: str, reason: str, chunk: int
) -> None:
    detok, deltas, ids = _stream(tok, text, chunk, stop=stops)
    assert detok.stopped and detok.stop_reason == reason
    assert "".join(deltas) == before == detok.output_text
    shown = ""
    for delta in deltas:
        shown += delta
        # what was shown is always a prefix of the text before the stop: no partial stop leaks
        assert before.startswith(shown)
    assert detok.flush() == "" and detok.step([1]) == ""


def test_stop_spanning_tokens(tok: Tokenizer) -> None:
    stop = "brown fox"
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    detok, deltas, _ = _stream(tok, "The quick brown fox jumps", stop=[stop])
    assert detok.stopped and "".join(deltas) == "The quick "


def test_false_alarm_is_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["the end"])
    ids = tok.encode("see the dog, then the cat", add_special_tokens=False)
    shown = ""
    for i in ids:
        shown += detok.step([i])
        assert not shown.endswith("the")
    assert not detok.stopped
    assert shown + detok.flush() == "see the dog, then the cat"


def test_held_prefix_flushed_at_end(tok: Tokenizer) -> None:
    detok, deltas, _ = _stream(tok, "almost at the EN", stop=["END!"])
    assert "".join(deltas) == "almost at the " and detok.pending_text == "EN"
    assert detok.flush() == "EN" and not detok.stopped


def test_stop_helpers() -> None:
    assert find_stop("abcdef", ["de", "bcd", "x"]) == (1, "bcd")
    assert find_stop("abcdef", ["cd", "c"]) == (2, "c")
    assert find_stop("abc", ["x"]) is None
    assert stop_prefix_len("hello wor", ["world", "or"]) == 3
    assert stop_prefix_len("hello", ["lo"]) == 0  # a full match is not a proper prefix
    assert stop_prefix_len("", ["a"]) == 0
