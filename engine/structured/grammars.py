"""Compiling constraints into llguidance matchers, off the event loop and the step thread.

``GrammarCache`` belongs to one engine and so to one tokenizer: a compiled matcher is cached
by its constraint (``StructuredOutput.key``), i.e. by (schema, tokenizer). A request gets a
``Guide`` holding a copy of a cached matcher (a copy costs ~30 µs; compiling the test schemas
~1 ms, building the tokenizer's token trie ~0.5 s once). Compiles run in the cache's own
threads (llguidance drops the GIL while it builds a parser); concurrent requests for one
constraint share one compile. A constraint that does not compile fails its request with
``InvalidRequestError`` naming the request field (the server's 400).

Lanes: llguidance's copies of one matcher share its lexer behind one mutex, which every mask
computation holds for its whole token-trie walk, so the masks of copies of one matcher are
computed one after another however many threads fill them. A constraint therefore keeps up to
``lanes`` independently compiled matchers (one per mask-fill thread, ``threads.fill_threads``);
a request takes the lane with the fewest live requests. A request that finds every lane busy
waits for one more to compile (~1 ms; up to ``lanes``, in the compile threads) or for one
being compiled, so a burst of requests for a new constraint spreads over the lanes from its
first token instead of sharing one lexer for its whole life.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.engine.structured.threads import fill_threads

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarCache", "Guide", "grammar_text"]

TIMES_KEPT = 4096  # compile / lane times a GrammarCache keeps (the latest)

# JSON as models write it: ", " and ": " between items, no other whitespace (free whitespace
# lets a small model emit newlines until max_tokens)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Guide:
    """One request's matcher: the tokens it accepted so far decide its next mask.

    Step thread only: ``accept`` after a step's tokens reach the host, the mask filled before
    the next step samples (``bitmask.fill_masks``).
    """

    __slots__ = ("lexer", "matcher", "seat", "spec")

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        spec: StructuredOutput,
        lexer: int = 0,
        seat: object = None,
    ) -> None:
        self.matcher = matcher
        self.spec = spec
        self.lexer = lexer  # which compiled matcher's lexer it shares (fill order)
        self.seat = seat  # its place on that lane (GrammarCache), freed with the guide

    def accept(self, token: int) -> None:
        m = self.matcher
        if not (m.is_stopped() or m.is_error()):
            m.consume_token(token)

    @property
    def failed(self) -> bool:
        """The matcher refused a token (the mask then allows only EOS)."""
        return self.matcher.is_error()


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not yet checked: the matcher reports errors)."""
    import llguidance

    m = llguidance.LLMatcher
    if spec.kind == "json":
        return m.grammar_from_json_schema(spec.value, defaults=_JSON_OPTIONS)
    if spec.kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return m.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        options = json.loads(spec.value)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    try:  # Lark as is; GBNF / EBNF converted
        return llguidance.grammar_from("grammar", spec.value)
    except ValueError as e:
        raise _CompileError(str(e)) from None


class GrammarCache:
    """Compiled matchers of one tokenizer, the least recently used constraint dropped past
    ``capacity`` constraints (each with up to ``lanes`` matchers, see the module docstring).

    ``tokenizer_json``: returns the tokenizer's ``tokenizer.json`` text (called once, in a
    compile thread, on the first structured request: engines that never see one pay nothing).
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_ids: list[int],
        *,
        capacity: int = 128,
        threads: int = 2,
        lanes: int | None = None,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # of the logits (may exceed the tokenizer's)
        self.eos_ids = sorted(eos_ids)
        self.capacity = capacity
        self.lanes = max(1, fill_threads() if lanes is None else lanes)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="loraplex-grammar")
        self._lock = threading.Lock()
        self._tok: llguidance.LLTokenizer | None = None
        # key -> _Lanes of compiled matchers, or the _CompileError of a constraint that does
        # not compile
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._pending: dict[tuple[str, str], asyncio.Future] = {}
        self._ids = itertools.count(1)
        # seconds per first compile / per further lane (benchmarks, stats): the latest
        # TIMES_KEPT, so a server that sees new constraints for days does not grow them
        self.compile_s: deque[float] = deque(maxlen=TIMES_KEPT)
        self.lane_s: deque[float] = deque(maxlen=TIMES_KEPT)
        self.hits = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (its token trie is built on first use: call off the loop)."""
        with self._lock:
            if self._tok is None:
                import llguidance

                eos = self.eos_ids or None
                self._tok = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=eos
                )
            return self._tok

    def compile(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """Blocking: a fresh matcher for ``spec`` (its own lexer); raises ``_CompileError``
        (``guide``: an ``InvalidRequestError`` naming the request field) when it does not
        compile."""
        import llguidance

        tok = self.tokenizer
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise _CompileError(matcher.get_error())
        # NOTE: the first mask builds lexer states lazily (up to ~15 ms on a fresh tokenizer);
        # here, not in the step thread: copies of this matcher share them
        matcher.compute_bitmask()
        return matcher

    def _lookup(self, key: tuple[str, str]) -> Any:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _store(self, key: tuple[str, str], value: Any) -> None:
        self._cache[key] = value
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    async def guide(self, spec: StructuredOutput) -> Guide:
        """Loop: a ``Guide`` for one request (compiled in the cache's threads on a miss)."""
        key = spec.key
        hit = self._lookup(key)
        if hit is None:
            fut = self._pending.get(key)
            if fut is None:
                fut = asyncio.get_running_loop().run_in_executor(self._pool, self._try, spec)
                self._pending[key] = fut
                fut.add_done_callback(lambda f, key=key: self._settle(key, f))
            # NOTE: shielded: a waiter that goes away (client gone) cancels neither the compile
            # nor the other waiters
            hit = await asyncio.shield(fut)
        else:
            self.hits += 1
        if isinstance(hit, _CompileError):
            raise InvalidRequestError(_message(spec, str(hit)), field=spec.field)
        lanes: _Lanes = hit
        while min(lanes.live) > 0:  # every lane busy: wait for one more (up to ``lanes``)
            if len(lanes.matchers) + len(lanes.compiling) < self.lanes and not lanes.stuck:
                self._grow(spec, lanes)
            if not lanes.compiling:
                break
            # NOTE: wait() leaves the compiles alone when this request goes away
            await asyncio.wait(lanes.compiling, return_when=asyncio.FIRST_COMPLETED)
        ident, matcher, seat = lanes.take()
        return Guide(matcher.deep_copy(), spec, ident, seat)

    def _settle(self, key: tuple[str, str], fut: asyncio.Future) -> None:
        self._pending.pop(key, None)
        if not fut.cancelled() and fut.exception() is None:
            self._store(key, fut.result())

    def _try(self, spec: StructuredOutput) -> Any:
        t0 = time.perf_counter()
        try:
            matcher = self.compile(spec)
        except _CompileError as e:
            return e  # cached: the same constraint fails again without compiling
        self.compile_s.append(time.perf_counter() - t0)
        return _Lanes((next(self._ids), matcher))

    def _grow(self, spec: StructuredOutput, lanes: _Lanes) -> None:
        """Loop: compile one more lane of ``spec`` in a compile thread (~1 ms)."""

        def lane() -> llguidance.LLMatcher:
            t0 = time.perf_counter()
            matcher = self.compile(spec)
            self.lane_s.append(time.perf_counter() - t0)
            return matcher

        def done(f: asyncio.Future) -> None:  # (before the waiters wake: added first)
            lanes.compiling.discard(f)
            if not f.cancelled() and f.exception() is None:
                lanes.add((next(self._ids), f.result()))
            else:
                lanes.stuck = True  # (not expected: the first lane compiled) no more lanes

        fut = asyncio.get_running_loop().run_in_executor(self._pool, lane)
        lanes.compiling.add(fut)
        fut.add_done_callback(done)


class _Lanes:
    """Independently compiled matchers of one constraint, (id, matcher); a request takes the
    lane with the fewest live requests (its ``_Seat`` frees the place when the request's
    ``Guide`` goes)."""

    __slots__ = ("compiling", "live", "matchers", "stuck")

    def __init__(self, first: tuple[int, Any]) -> None:
        self.matchers = [first]
        self.live = [0]  # live guides per lane
        self.compiling: set[asyncio.Future] = set()  # lanes being compiled
        self.stuck = False  # a lane failed to compile: no more

    def add(self, lane: tuple[int, Any]) -> None:
        self.matchers.append(lane)
        self.live.append(0)

    def take(self) -> tuple[int, Any, _Seat]:
        j = self.live.index(min(self.live))
        self.live[j] += 1
        ident, matcher = self.matchers[j]
        return ident, matcher, _Seat(self, j)


class _Seat:
    """A request's place on a lane, given back when its guide is dropped. (The count only
    balances the lanes: a lost update between threads costs balance, never correctness.)"""

    __slots__ = ("j", "lanes")

    def __init__(self, lanes: _Lanes, j: int) -> None:
        self.lanes = lanes
        self.j = j

    def __del__(self) -> None:
        self.lanes.live[self.j] -= 1


class _CompileError(Exception):
    """llguidance's reason why a constraint does not compile."""


def _message(spec: StructuredOutput, error: str) -> str:
    what = {
        "json": "the JSON schema",
        "json_object": "the JSON object grammar",
        "regex": "the regular expression",
        "choice": "the choice list",
        "grammar": "the grammar",
    }[spec.kind]
    error = error.strip()
    if len(error) > 500:
        error = error[:500] + "..."
    return f"{spec.field}: {what} is not supported or does not compile: {error}"
