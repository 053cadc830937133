"""Adapters that added tokens: full ``embed_tokens`` / ``lm_head`` tables (modules_to_save,
model/lora/full.py) with V + k rows for a base vocabulary of V, served with
``lora_extra_vocab_size`` = E >= k.

Such an adapter brings its own ``tokenizer.json`` (PEFT users save it next to the adapter after
``add_tokens`` + ``resize_token_embeddings``). It is accepted only if that tokenizer has
exactly V + k ids and agrees with the base tokenizer on every id < V (its added tokens are ids
V..V+k-1); requests on the adapter are tokenized and detokenized with it (core.py). Its
tables sit in (V + E, H) slots; rows of other slots never sample an id >= V, and the adapter's
own rows never one >= V + k (``FullModules.widen_logits``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from loraplex.engine.errors import AdapterConfigError, AdapterShapeError

__all__ = ["TOKENIZER_FILE", "check_adapter_vocab"]

TOKENIZER_FILE = "tokenizer.json"


def check_adapter_vocab(folder: str | Path, base: Any, vocab: int, rows: int) -> None:
    """Check the ``tokenizer.json`` of the adapter in ``folder``, whose tables have ``rows`` >
    ``vocab`` rows, against the base's (``base``: its ``tokenizers.Tokenizer``, or None);
    typed errors (HTTP 400) name what differs. The engine loads the tokenizer after."""
    added = rows - vocab
    what = f"the adapter adds {added} tokens (its tables have {rows} rows, the base {vocab})"
    if base is None:
        raise AdapterConfigError(
            f"{what}, but the base model has no tokenizer to check the adapter's against",
            field=TOKENIZER_FILE,
        )
    folder = Path(folder)
    if not (folder / TOKENIZER_FILE).is_file():
        raise AdapterConfigError(
            f"{what}, but its folder has no {TOKENIZER_FILE} (save the tokenizer with the adapter)",
            field=TOKENIZER_FILE,
        )
    try:
        tok = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
        raise AdapterConfigError(
            f"{what}; its {TOKENIZER_FILE} cannot be loaded: {e}", field=TOKENIZER_FILE
        ) from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != rows:
        raise AdapterShapeError(
            f"{TOKENIZER_FILE} has {size} tokens, but the adapter's embed_tokens / "
            f"lm_head tables have {rows} rows (base vocabulary {vocab} + {added} added)",
            field=TOKENIZER_FILE,
        )
    mine = tok.get_vocab(with_added_tokens=True)
    theirs = base.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in mine.items()}
    for token, i in sorted(theirs.items(), key=lambda e: e[1]):
        if i >= vocab:
            continue
        if mine.get(token) != i:
            raise AdapterConfigError(
                f"{TOKENIZER_FILE} does not extend the base tokenizer: id {i} is "
                f"{by_id.get(i)!r} in the adapter's, {token!r} in the base's (an adapter may "
                f"only add tokens at ids {vocab}..{rows - 1})",
                field=TOKENIZER_FILE,
            )
    base_ids = {i for i in theirs.values() if i < vocab}
    extra = sorted(i for i in by_id if i < vocab and i not in base_ids)
    if extra:
        raise AdapterConfigError(
            f"{TOKENIZER_FILE} does not extend the base tokenizer: id {extra[0]} is "
            f"{by_id[extra[0]]!r} in the adapter's, absent from the base's",
            field=TOKENIZER_FILE,
        )
