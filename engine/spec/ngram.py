"""Prompt lookup (n-gram) proposer: proposes the tokens that followed the latest earlier
occurrence of the request's own last tokens.

Outputs that quote their prompt (rewrite, extract, SQL over a given schema, code edits) repeat
runs of it; once the output's last ``n`` tokens match an earlier run of prompt + output, the
tokens that followed that run are a cheap guess of what comes next. No model, no state: it
works for every adapter at once (the verifier runs each row with its own adapter).

Matching: the longest suffix of ``max_n`` down to ``min_n`` tokens (the engine's defaults 4
and 1: ``speculative_ngram_max`` / ``_min``) that occurs earlier in prompt + output; among
matches of that length the most recent wins (the closest context). The proposal is the (up to
``k``) tokens after it.

Why ``min_n`` 1: a 1-token match is often a common token (a space, a comma, "the") whose
latest occurrence is followed by something else. On the answers of benchmarks/spec_quoting.py
that do not quote, a 1-token match kept 0.27 tokens per verify step of K = 4 (per-position
acceptance 0.2, about the break-even of a GPU verify step), a 2-token match 0.9, a 4-token
match 3.0. But where an answer starts quoting, right after its first quoted token only a
1-token match exists, and it is right: with ``min_n`` 2 the quoting answers kept 3.4 tokens
per verify step instead of 3.75. The per-request backoff (backoff.py) already stops proposing
for a request whose matches keep failing, so 1 stays the default; 2 trades the start of each
quote for fewer junk proposals.

Cost, per row and step while speculation is on (small batches, ``spec/control.py``): the
proposer keeps, per running request, where each token and each adjacent pair occurs
(extended by the tokens since its last step, as a request's tokens only grow), so a step
compares only the earlier occurrences of the last two tokens, latest first (with none, the
last token's latest occurrence is the match). ``lookup``, the same search as one backward scan
of the whole context in Python (its reference twin), took ~25 us a row at a 600-token context
and ~170 us at 4 000 (2-core VM): ~1.4 ms of host time between two verify steps of 8 such rows.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable, Sequence

from loraplex.engine.request import Request, Tokens
from loraplex.engine.spec.proposer import Proposal

__all__ = ["NgramProposer", "lookup"]


def lookup(tokens: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (``max_n`` down to ``min_n`` tokens long); [] when none occurs."""
    seq = list(tokens)
    size = len(seq)
    if k <= 0 or size < 2:
        return []
    last = seq[-1]
    # j: where an earlier occurrence of the suffix ends (strictly before the last position)
    ends = (j for j in range(size - 2, -1, -1) if seq[j] == last)
    return _follow(seq, ends, k, max_n, min_n)


def _follow(
    tokens: Sequence[int], ends: Iterable[int], k: int, max_n: int, min_n: int
) -> list[int]:
    """The ``k`` tokens after the longest match of ``tokens``' suffix that ends at one of
    ``ends`` (positions holding the last token, latest first: the first longest wins)."""
    size = len(tokens)
    best_len, best_end = 0, -1
    for j in ends:
        m = 1
        while m < max_n and j - m >= 0 and tokens[j - m] == tokens[size - 1 - m]:
            m += 1
        if m > best_len:
            best_len, best_end = m, j
            if m == max_n:
                break  # the longest possible; scanning backwards, the most recent of them
    if best_len < min_n:
        return []
    return list(tokens[best_end + 1 : best_end + 1 + k])


class NgramProposer:
    """``Proposer`` by prompt lookup (``lookup``'s matches): deterministic, ``probs`` None (a
    point mass). Keeps a ``_Positions`` index per request (dropped by ``release``, or with the
    request)."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n = max_n
        self.min_n = min_n
        self._index: weakref.WeakKeyDictionary[Request, _Positions] = weakref.WeakKeyDictionary()

    def propose(self, reqs: Sequence[Request], k: int) -> list[Proposal]:
        out = []
        for r in reqs:
            idx = self._index.get(r)
            if idx is None:
                idx = self._index[r] = _Positions()
            out.append(Proposal(idx.lookup(r.tokens, k, self.max_n, self.min_n)))
        return out

    def commit(self, req: Request, num_accepted: int) -> None:
        """Nothing to roll back: only accepted tokens join a request's tokens (and its index)."""

    def release(self, req: Request) -> None:
        self._index.pop(req, None)


_TAIL = 4  # indexed tokens re-read each step: a history that changed under them re-indexes


class _Positions:
    """Where each token and each pair of adjacent tokens of one request's tokens occur
    (ascending positions of the token, of the pair's second), up to ``size``."""

    __slots__ = ("one", "two", "size", "tail", "lists")

    def __init__(self) -> None:
        self.one: dict[int, list[int]] = {}
        self.two: dict[tuple[int, int], list[int]] = {}
        self.size = 0
        self.tail: list[int] = []  # the last indexed tokens, to notice a changed history
        self.lists: tuple[int, ...] = ()  # ids of the prompt and output lists indexed

    def update(self, tokens: Sequence[int]) -> None:
        size = len(tokens)
        keep = len(self.tail)
        lists = tuple(map(id, tokens.parts())) if isinstance(tokens, Tokens) else ()
        if (
            size < self.size
            or lists != self.lists
            or (keep and tokens[self.size - keep : self.size] != self.tail)
        ):  # not an extension of what was indexed: start again
            self.one, self.two, self.size, self.lists = {}, {}, 0, lists
        if size == self.size:
            return
        lo = self.size
        new = tokens[max(lo - 1, 0) : size]  # with the token before, for the first pair
        one, two = self.one, self.two
        prev = new[0] if lo else None
        for i, t in enumerate(new[1:] if lo else new, lo):
            one.setdefault(t, []).append(i)
            if prev is not None:
                two.setdefault((prev, t), []).append(i)
            prev = t
        self.size = size
        self.tail = list(tokens[max(size - _TAIL, 0) : size])

    def lookup(self, tokens: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
        """``lookup(tokens, k, max_n, min_n)``: where the last two tokens occur earlier, the
        longest match is among those; otherwise the last token's latest earlier occurrence."""
        self.update(tokens)
        size = len(tokens)
        if k <= 0 or size < 2:
            return []
        if max_n >= 2:
            ends = self.two.get((tokens[size - 2], tokens[size - 1]), [])
            cut = bisect.bisect_left(ends, size - 1)  # before the last position
            if cut:
                latest_first = (ends[c] for c in range(cut - 1, -1, -1))
                return _follow(tokens, latest_first, k, max_n, min_n)
        ends = self.one[tokens[size - 1]]
        cut = bisect.bisect_left(ends, size - 1)
        if not cut or min_n > 1:
            return []
        return list(tokens[ends[cut - 1] + 1 : ends[cut - 1] + 1 + k])
