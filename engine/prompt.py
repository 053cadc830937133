"""A request's prompt: its token ids checked against the model and the KV cache, and its
incremental detokenizer (both with the adapter's own tokenizer when it added tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from loraplex.engine.adapters.version import AdapterVersion
    from loraplex.engine.kv import BlockManager
    from loraplex.engine.request import Request
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.tokenizer import Tokenizer

__all__ = ["encode_prompt", "detokenizer_for"]


def encode_prompt(
    prompt: str | Sequence[int],
    params: SamplingParams,
    version: AdapterVersion | None,
    *,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
    blocks: BlockManager,
) -> list[int]:
    """The prompt's token ids (typed errors naming the field: no tokenizer for a text prompt,
    ids out of the vocabulary, empty, too long for the context or the KV cache). ``version``:
    the request's adapter (its own tokenizer and vocabulary when it added tokens)."""
    own = version.tokenizer if version is not None else None  # an adapter's added tokens
    tok = own if own is not None else tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", field="prompt")
        ids = tok.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        vocab = version.vocab_rows if own is not None else vocab_size  # type: ignore[union-attr]
        if any(t < 0 or t >= vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})", field="prompt")
    if not ids:
        raise InvalidRequestError("the prompt is empty", field="prompt")
    if len(ids) + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"maximum context length {max_model_len}",
            field="max_tokens",
        )
    if blocks.blocks_needed(len(ids) + params.max_tokens) > blocks.num_blocks:
        raise InvalidRequestError("the request does not fit in the KV cache", field="max_tokens")
    return ids


def detokenizer_for(req: Request, tokenizer: Any) -> IncrementalDetokenizer | None:
    """``req``'s incremental detokenizer (with its adapter's tokenizer when it added tokens),
    or None without a tokenizer (token-id outputs only)."""
    own = req.adapter.tokenizer if req.adapter is not None else None  # added tokens
    tok = own if own is not None else tokenizer
    if tok is None:
        return None
    return IncrementalDetokenizer(tok, req.prompt_ids, stop=req.params.stop)
