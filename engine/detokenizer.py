"""Incremental (streaming) detokenization with stop-string handling.

Each step decodes only a small window of token ids (prefix offset / read offset): the text of
``ids[prefix:read]`` is already shown, and whatever ``ids[prefix:]`` decodes to beyond it is new.
New text is held back while it ends in U+FFFD (an incomplete UTF-8 character) and while its tail
could still be the beginning of a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "find_stop", "stop_prefix_len"]

# How many prompt tokens give context to the first output token (leading spaces, merges).
INITIAL_WINDOW = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def find_stop(text: str, stops: Iterable[str]) -> tuple[int, str] | None:
    """Earliest (index, stop) occurrence of any stop string in ``text`` (shortest on ties)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        idx = text.find(stop)
        if idx >= 0 and (best is None or (idx, len(stop)) < best[:2]):
            best = (idx, len(stop), stop)
    return None if best is None else (best[0], best[2])


def stop_prefix_len(text: str, stops: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    NOTE: runs per generated token, so it only visits the places where a stop string's first
    character occurs in the last ``len(stop) - 1`` characters (C-level ``find`` / compare), not
    every suffix length in Python.
    """
    longest = 0
    n = len(text)
    for stop in stops:
        first = stop[:1]
        i = text.find(first, max(n - len(stop) + 1, 0)) if first else -1
        while i != -1 and n - i > longest:
            if stop.startswith(text[i:]):
                longest = n - i  # the earliest match is this stop's longest
                break
            i = text.find(first, i + 1)
    return longest


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into safe text deltas.

    ``step(ids)`` returns the new text that can be shown now; ``flush()`` returns what was held
    back once the request ends for a reason other than a stop string. After a stop string matched,
    ``stopped`` is True, ``stop_reason`` is that string, and the text before it has been returned
    (the stop string itself never is). The first stop string to appear completely wins, as in
    vLLM. Do not feed the final EOS / stop token id if its text must
    not appear (vLLM does not show it).
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] | str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if isinstance(stop, str):
            stop = [stop]
        self.stop: list[str] = [s for s in (stop or ()) if s]
        # Window of ids; only the tail of the prompt is kept as context.
        self._ids: list[int] = list(prompt_ids[-INITIAL_WINDOW:]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)
        self._pending = ""
        self.output_text = ""
        self.num_output_tokens = 0
        self.stopped = False
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _new_text(self, final: bool) -> str:
        """Text of the ids past the read offset; empty while it ends mid-character."""
        shown = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(shown) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return full[len(shown) :]

    def _emit(self, delta: str, final: bool) -> str:
        text = self._pending + delta
        self._pending = ""
        if self.stop:
            hit = find_stop(text, self.stop)
            if hit is not None:
                idx, self.stop_reason = hit
                self.stopped = True
                text = text[:idx]
            elif not final:
                hold = stop_prefix_len(text, self.stop)
                if hold:
                    text, self._pending = text[:-hold], text[-hold:]
        self.output_text += text
        return text

    def step(self, new_token_ids: Iterable[int]) -> str:
        """Add generated ids; return the text that became safe to show (maybe ``""``)."""
        new = list(new_token_ids)
        if self.stopped or not new:
            return ""
        self._ids.extend(new)
        self.num_output_tokens += len(new)
        return self._emit(self._new_text(final=False), final=False)

    def flush(self) -> str:
        """Return all held-back text (incomplete characters included); ``""`` after a stop."""
        if self.stopped:
            return ""
        return self._emit(self._new_text(final=True), final=True)

    @property
    def pending_text(self) -> str:
        """Decoded text held back because it may begin a stop string."""
        return self._pending
