"""Tokenizer loading, encode/decode, chat templates; cross-checked against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.engine.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    TokenizerError,
    TokenizerNotFoundError,
)
from tests.helpers.tokenizers import BOS_ID, EOS_ID, UNK_ID, make_tokenizer

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and\ttabs\nand newlines\n",
    "Caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c \U0001f600\U0001f389 \u00e9t\u00e9",
    "def f(x):\n    return x * 2  # comment",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_helper_is_small_and_deterministic(tmp_path: Path) -> None:
    a = make_tokenizer(tmp_path / "a")
    b = make_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert Tokenizer.from_dir(a).vocab_size <= 256
    big = Tokenizer.from_dir(make_tokenizer(tmp_path / "c", vocab_size=400))
    assert 256 < big.vocab_size <= 400
    assert big.decode(big.encode(TEXTS[3])) == TEXTS[3]
    with pytest.raises(ValueError):
        make_tokenizer(tmp_path / "d", vocab_size=100)


def test_special_ids(tok: Tokenizer) -> None:
    assert tok.bos_token_id == BOS_ID
    assert tok.eos_token_id == EOS_ID
    assert tok.eos_token_ids == {EOS_ID}
    assert tok.token_to_id("<unk>") == UNK_ID
    assert tok.id_to_token(EOS_ID) == "</s>"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == BOS_ID
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_decode_ignores_unknown_ids(tok: Tokenizer) -> None:
    ids = tok.encode("abc", add_special_tokens=False)
    assert tok.decode([*ids, tok.vocab_size + 3]) == "abc"


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(tok: Tokenizer, tok_dir: Path, text: str) -> None:
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    for special in (True, False):
        expected = ref(text, add_special_tokens=special)["input_ids"]
        assert tok.encode(text, add_special_tokens=special) == expected
    ids = tok.encode(text)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_chat_template(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi!</s>\n<|assistant|>\nHello.</s>\n"
        "<|user|>\nWhat is 2+2?</s>\n<|assistant|>\n"
    )
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 4


def test_chat_template_matches_transformers(tok_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    template = (
        "{%- for m in messages %}\n"
        "    {%- if m.role == 'user' %}\n"
        "        [U] {{ m.content | trim }}\n"
        "    {% else %}\n"
        "        [A] {{ m.content }}{{ eos_token }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}[A]{% endif %}"
    )
    d = make_tokenizer(tmp_path, chat_template=template)
    ours = Tokenizer.from_dir(d)
    ref = AutoTokenizer.from_pretrained(str(d))
    tools = [{"name": "f", "description": "\u00e9t\u00e9"}]
    for gen in (True, False):
        expected = ref.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen, tools=tools
        )
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen, tools=tools) == (
            expected
        )


def test_chat_template_errors(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    bare = Tokenizer.from_dir(make_tokenizer(tmp_path / "bare", chat_template=None))
    assert not bare.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template(MESSAGES)
    broken = Tokenizer.from_dir(make_tokenizer(tmp_path / "broken", chat_template="{% if %}"))
    with pytest.raises(ChatTemplateError):
        broken.apply_chat_template(MESSAGES)
    assert issubclass(ChatTemplateError, TokenizerError)


def test_template_sources(tmp_path: Path) -> None:
    d = make_tokenizer(tmp_path)
    (d / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_dir(d).apply_chat_template(MESSAGES) == "J4"
    override = Tokenizer.from_dir(d, chat_template="O{{ bos_token }}")
    assert override.apply_chat_template(MESSAGES) == "O<s>"
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).apply_chat_template(MESSAGES) == "D"


def test_missing_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerNotFoundError):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(tmp_path)


def test_eos_ids_from_model_configs(tmp_path: Path) -> None:
    d = make_tokenizer(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 7, "bos_token_id": 1}))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == {2, 5, 7} and tok.eos_token_id == EOS_ID


def test_add_bos_token_flag(tmp_path: Path) -> None:
    d = make_tokenizer(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    plain = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == [*plain, EOS_ID]
