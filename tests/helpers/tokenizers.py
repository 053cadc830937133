"""Tiny deterministic byte-level BPE tokenizer for tests.

``make_tokenizer(dir)`` trains a BPE with the ``tokenizers`` library on a fixed in-code text and
writes ``tokenizer.json`` + ``tokenizer_config.json`` (bos ``<s>``, eos ``</s>``, unk ``<unk>``,
``add_bos_token`` true, a small chat template) so a test model dir with ``vocab_size`` ~256 can
hold it. Ids: ``<unk>`` = 0, ``<s>`` = 1, ``</s>`` = 2.

When ``vocab_size`` is too small for all 256 bytes, the alphabet keeps printable ASCII,
``\\t\\n\\r`` and every byte that can occur in valid UTF-8 text; other control bytes map to
``<unk>``. Any ordinary text (accents, CJK, emoji) round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "make_tokenizer",
    "CHAT_TEMPLATE",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "SPECIAL_TOKENS",
    "TRAINING_TEXT",
]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TRAINING_TEXT: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Hello world! Hello there, how are you today? I am fine, thank you.",
    "Once upon a time there was a little model that served many adapters at once.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "<|system|>\nYou are a helpful assistant.\n<|user|>\nWhat is the capital of France?\n",
    "<|assistant|>\nThe capital of France is Paris.\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000. Symbols: !@#$%^&*()[]{}<>?/\\|~`'\";:",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe. \u4f60\u597d\uff0c\u4e16\u754c\u3002 "
    "\U0001f600 \U0001f389 \U0001f680",
)

# Bytes kept when the vocab cannot hold all 256: printable ASCII, \t \n \r, UTF-8 continuation
# bytes (0x80-0xBF) and lead bytes (0xC2-0xF4).
_SMALL_ALPHABET = (
    list(range(0x20, 0x7F)) + [0x09, 0x0A, 0x0D] + list(range(0x80, 0xC0)) + list(range(0xC2, 0xF5))
)
_MIN_MERGES = 16


def _byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable-char table that the ByteLevel pre-tokenizer uses."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _build(vocab_size: int) -> Tokenizer:
    table = _byte_to_unicode()
    full = vocab_size >= 256 + len(SPECIAL_TOKENS) + _MIN_MERGES
    alphabet = range(256) if full else _SMALL_ALPHABET
    floor = len(alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size {vocab_size} is too small (needs at least {floor})")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=[table[b] for b in alphabet],
        show_progress=False,
    )
    tok.train_from_iterator(list(TRAINING_TEXT), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    assert tok.get_vocab_size() <= vocab_size
    return tok


def make_tokenizer(
    dir: str | Path, vocab_size: int = 256, *, chat_template: str | None = CHAT_TEMPLATE
) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``dir``; returns ``dir``.

    The vocab (specials included) has at most ``vocab_size`` entries. ``chat_template=None``
    leaves the template out of the config.
    """
    path = Path(dir)
    path.mkdir(parents=True, exist_ok=True)
    _build(vocab_size).save(str(path / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def swap_token_ids(
    tokenizer_dir: Path, dest: Path, ids: tuple[int, int] = (40, 41)
) -> tuple[str, str]:
    """Write ``tokenizer_dir``'s tokenizer.json into ``dest`` with the tokens at ``ids``
    swapped (a tokenizer that no longer extends the one it came from); returns the tokens
    that were at ``ids[0]`` and ``ids[1]``."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in ids)
    vocab[a], vocab[b] = ids[1], ids[0]
    (dest / "tokenizer.json").write_text(json.dumps(data))
    return a, b
