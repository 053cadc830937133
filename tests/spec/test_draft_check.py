"""A draft model that does not share the target's vocabulary is refused at start-up with a typed
error naming ``--speculative-model`` (engine/spec/draft_check.py, DraftProposer)."""

from __future__ import annotations

import json

import pytest

from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.errors import ModelConfigError
from loraplex.engine.spec.draft import DraftProposer
from loraplex.engine.spec.draft_check import DraftModelMismatchError, check_draft_vocab
from loraplex.engine.tokenizer import Tokenizer
from tests.helpers.models import make_tiny_model
from tests.helpers.tokenizers import make_tokenizer

SMALL = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("target") / "m", seed=1)
    make_tokenizer(d)
    return d


def draft(tmp_path, name="d", tokenizer_vocab=256, **overrides):
    d = make_tiny_model(tmp_path / name, seed=2, **{**SMALL, **overrides})
    make_tokenizer(d, vocab_size=tokenizer_vocab)
    return d


def build(draft_dir, target_dir):
    return DraftProposer(
        draft_dir, num_blocks=8, block_size=4,
        target_config=ModelConfig.from_dir(target_dir),
        target_tokenizer=Tokenizer.from_dir(target_dir),
    )  # fmt: skip


def test_same_vocabulary_passes(target, tmp_path):
    d = build(draft(tmp_path), target)
    assert d.vocab_size == 256


@pytest.mark.parametrize(
    ("overrides", "what"),
    [
        (dict(vocab_size=320), "vocab_size"),
        (dict(eos_token_id=3), "eos_token_id"),
        (dict(bos_token_id=0), "bos_token_id"),
    ],
)
def test_config_mismatch_is_refused(target, tmp_path, overrides, what):
    with pytest.raises(DraftModelMismatchError, match="--speculative-model") as e:
        build(draft(tmp_path, **overrides), target)
    assert what in str(e.value)
    assert isinstance(e.value, ModelConfigError) and e.value.field == "speculative_model"


def test_tokenizer_mismatch_is_refused(target, tmp_path):
    """Same config ids, another tokenizer (fewer merges: other tokens at the same ids)."""
    with pytest.raises(DraftModelMismatchError, match="--speculative-model.*tokenizer"):
        build(draft(tmp_path, tokenizer_vocab=230), target)


def test_tokens_at_sampled_ids_are_compared(target, tmp_path):
    d = draft(tmp_path)
    spec = json.loads((d / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # swap two tokens' ids: same size, same specials
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(spec))
    ours, theirs = Tokenizer.from_dir(d), Tokenizer.from_dir(target)
    cfg = ModelConfig.from_dir(target)
    check_draft_vocab(cfg, cfg)  # configs alone agree
    bad = {i for i in range(256) if ours.id_to_token(i) != theirs.id_to_token(i)}
    assert bad == {100, 101}
    # a sample every 4 ids on a 256-token vocabulary sees id 100
    with pytest.raises(DraftModelMismatchError, match="token at id 100"):
        check_draft_vocab(cfg, cfg, ours, theirs)
