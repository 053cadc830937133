"""Logprobs in the two OpenAI shapes: legacy completions and chat ``content`` entries."""

from __future__ import annotations

import math
from typing import Any

from loraplex.engine.request import TokenLogprob
from loraplex.engine.tokenizer import Tokenizer

__all__ = ["TokenNamer", "CompletionLogprobs", "chat_logprobs"]

FLOOR = -9999.0  # JSON has no -inf: the lowest logprob reported


def _lp(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class TokenNamer:
    """Token id -> the string clients see (decoded text, or ``token_id:N``)."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool) -> None:
        self.tokenizer = None if as_ids else tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobs:
    """Builds ``{tokens, token_logprobs, top_logprobs, text_offset}`` chunk by chunk; the sampled
    token is always in its position's ``top_logprobs`` (so up to k + 1 entries, as in vLLM)."""

    def __init__(self, name: TokenNamer, k: int) -> None:
        self.name = name
        self.k = k
        self.offset = 0

    def chunk(self, lps: list[TokenLogprob]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for lp in lps:
            token = self.name(lp.token_id)
            top = {self.name(t): _lp(v) for t, v in lp.top[: self.k]}
            top.setdefault(token, _lp(lp.logprob))
            out["tokens"].append(token)
            out["token_logprobs"].append(_lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out


def _entry(name: TokenNamer, token_id: int, logprob: float) -> dict[str, Any]:
    token = name(token_id)
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(name: TokenNamer, k: int, lps: list[TokenLogprob]) -> dict[str, Any]:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`` for ``lps``."""
    content = []
    for lp in lps:
        item = _entry(name, lp.token_id, lp.logprob)
        item["top_logprobs"] = [_entry(name, t, v) for t, v in lp.top[:k]]
        content.append(item)
    return {"content": content}
