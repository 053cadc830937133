"""Start-up check that a draft model speaks the target's vocabulary.

A draft proposes token ids that the target verifies and its probabilities are compared row by
row with the target's (rejection sampling), so both must number the same tokens the same
way: the same logits width, the same special ids, the same token at every id. Checked from
the two config.json files and, where both folders hold one, the two tokenizers (a sample of
ids spread over the vocabulary, not all of it: a few ms for a 150k vocabulary).
"""

from __future__ import annotations

from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.errors import ModelConfigError
from loraplex.engine.tokenizer import Tokenizer

__all__ = ["DraftModelMismatchError", "check_draft_vocab"]

FLAG = "--speculative-model"
FIELD = "speculative_model"
SAMPLED_IDS = 64  # ids compared between the two tokenizers, evenly spread


class DraftModelMismatchError(ModelConfigError):
    """The draft model of ``--speculative-model`` does not share the target's vocabulary or
    tokenizer. ``field`` names the config field (``speculative_model``)."""

    field = FIELD


def _fail(what: str, draft: object, target: object) -> DraftModelMismatchError:
    return DraftModelMismatchError(
        f"{FLAG}: the draft model's {what} ({draft!r}) differs from the target model's "
        f"({target!r}); a draft model must use the target's tokenizer and vocabulary"
    )


def check_draft_vocab(
    draft: ModelConfig,
    target: ModelConfig,
    draft_tokenizer: Tokenizer | None = None,
    target_tokenizer: Tokenizer | None = None,
) -> None:
    """Raise ``DraftModelMismatchError`` unless the draft numbers tokens as the target does:
    equal ``vocab_size``, BOS and EOS ids in both configs, and (both tokenizers given) equal
    tokenizer size, special ids and tokens at sampled ids."""
    if draft.vocab_size != target.vocab_size:
        raise _fail("vocab_size", draft.vocab_size, target.vocab_size)
    if None not in (draft.bos_token_id, target.bos_token_id) and (
        draft.bos_token_id != target.bos_token_id
    ):
        raise _fail("bos_token_id", draft.bos_token_id, target.bos_token_id)
    if (
        draft.eos_token_ids
        and target.eos_token_ids
        and (set(draft.eos_token_ids) != set(target.eos_token_ids))
    ):
        raise _fail("eos_token_id", sorted(draft.eos_token_ids), sorted(target.eos_token_ids))
    if draft_tokenizer is None or target_tokenizer is None:
        return
    d, t = draft_tokenizer, target_tokenizer
    if d.vocab_size != t.vocab_size:
        raise _fail("tokenizer size", d.vocab_size, t.vocab_size)
    for what in ("bos_token_id", "eos_token_id"):
        if getattr(d, what) != getattr(t, what):
            raise _fail(f"tokenizer {what}", getattr(d, what), getattr(t, what))
    size = t.vocab_size
    step = max(1, size // SAMPLED_IDS)
    ids = sorted({*range(0, size, step), *range(max(0, size - 8), size)})
    for i in ids:
        if d.id_to_token(i) != t.id_to_token(i):
            raise _fail(f"token at id {i}", d.id_to_token(i), t.id_to_token(i))
