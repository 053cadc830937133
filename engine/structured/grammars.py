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

Untrusted input: a constraint the cache has not seen is first converted, compiled and exercised
in the grammar sandbox (sandbox.py: helper processes, where a crash ends only the helper); the
cache then compiles the grammar text the sandbox returned. A constraint that crashed the sandbox,
ran past ``compile_timeout_s`` or needs more than ``cache_bytes`` is refused (a 400 naming the
request field). Refused constraints are remembered by digest apart from the grammars' LRU (up to
``REFUSED_KEPT``), so a crasher is run and logged once, not again after 128 others; a timeout
is not remembered (the same input may fit the budget when the machine is less busy). Its
waiters going away cancels a compile (the sandbox kills its helper). Entries are evicted by bytes (``cache_bytes``, the heap the sandbox measured
per matcher, times the lanes) as well as by count (``capacity``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog

from loraplex.engine.errors import EngineError, InvalidRequestError
from loraplex.engine.structured import sandbox_helper
from loraplex.engine.structured.sandbox import (
    GrammarSandbox,
    SandboxCrash,
    SandboxError,
    SandboxTimeout,
    SandboxUnavailable,
)
from loraplex.engine.structured.sandbox_helper import SandboxInit
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.engine.structured.threads import fill_threads

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarCache", "Guide", "grammar_text", "COMPILE_STACK_BYTES"]

log = structlog.get_logger("loraplex.structured")

TIMES_KEPT = 4096  # compile / lane times a GrammarCache keeps (the latest)
REFUSED_KEPT = 4096  # digests of refused constraints a GrammarCache remembers (the latest)
# the stack of the cache's compile threads: 4 x the sandbox's (sandbox_helper.STACK_BYTES), so
# a grammar whose compile recursed deep but fit there fits here (virtual memory only)
COMPILE_STACK_BYTES = 4 * sandbox_helper.STACK_BYTES
TIMEOUT_FLAG = "--grammar-compile-timeout"
BYTES_FLAG = "--grammar-cache-bytes"


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
    """The llguidance grammar of ``spec`` (not yet checked: the matcher reports errors).
    NOTE: untrusted input: the cache only runs this in its sandbox processes."""
    try:
        return sandbox_helper.grammar_text(spec.kind, spec.value)
    except sandbox_helper.ConstraintError as e:
        raise _CompileError(str(e)) from None


class GrammarCache:
    """Compiled matchers of one tokenizer, the least recently used constraint dropped past
    ``capacity`` constraints or ``cache_bytes`` (each with up to ``lanes`` matchers, see the
    module docstring).

    ``tokenizer_json``: returns the tokenizer's ``tokenizer.json`` text (called once, in a
    compile thread, on the first structured request: engines that never see one pay nothing).
    ``compile_timeout_s``: the sandbox's budget per constraint (None: none); ``processes``: the
    sandbox's helper processes (compiles of new constraints at once).
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
        compile_timeout_s: float | None = 10.0,
        cache_bytes: int = 1 << 30,
        processes: int = 2,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # of the logits (may exceed the tokenizer's)
        self.eos_ids = sorted(eos_ids)
        self.capacity = capacity
        self.compile_timeout_s = compile_timeout_s
        self.cache_bytes = cache_bytes
        self.lanes = max(1, fill_threads() if lanes is None else lanes)
        self._pool = _compile_pool(threads)
        self.sandbox = GrammarSandbox(self._sandbox_init, processes)
        self._lock = threading.Lock()
        self._tok: llguidance.LLTokenizer | None = None
        # key -> _Lanes of compiled matchers, or the _CompileError of a constraint refused
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._pending: dict[tuple[str, str], _Pending] = {}
        # digest -> why, for every constraint refused: apart from the grammars' LRU, so that a
        # refused input stays refused (and is not run, nor logged, again) however many others
        # pass through the cache
        self._refused: OrderedDict[str, _CompileError] = OrderedDict()
        self.nbytes = 0  # of the cached entries (``_weight``)
        self._ids = itertools.count(1)
        # seconds per first compile / per further lane (benchmarks, stats): the latest
        # TIMES_KEPT, so a server that sees new constraints for days does not grow them
        self.compile_s: deque[float] = deque(maxlen=TIMES_KEPT)
        self.lane_s: deque[float] = deque(maxlen=TIMES_KEPT)
        self.hits = 0
        self.refused = 0  # constraints refused by the sandbox (crash, budget, bytes)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.sandbox.close()

    def _sandbox_init(self) -> SandboxInit:
        return SandboxInit(
            self._tokenizer_json(), self.vocab_size, tuple(self.eos_ids),
            memory_bytes=max(self.cache_bytes, 256 << 20) + (512 << 20),
        )  # fmt: skip

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

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """Blocking: a fresh matcher (its own lexer) for a grammar text that came through the
        sandbox; raises ``_CompileError`` when it does not compile."""
        try:
            # NOTE: the first mask builds lexer states lazily (up to ~15 ms on a fresh
            # tokenizer); here, not in the step thread: copies of this matcher share them
            return sandbox_helper.build_matcher(self.tokenizer, grammar)
        except sandbox_helper.ConstraintError as e:
            raise _CompileError(str(e)) from None

    def _lookup(self, key: tuple[str, str]) -> Any:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def _store(self, key: tuple[str, str], value: Any) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self.nbytes -= _weight(old)
        self._cache[key] = value
        self.nbytes += _weight(value)
        self._trim()

    def _trim(self) -> None:
        while len(self._cache) > 1 and (
            len(self._cache) > self.capacity or self.nbytes > self.cache_bytes
        ):
            _, old = self._cache.popitem(last=False)
            self.nbytes -= _weight(old)

    async def guide(self, spec: StructuredOutput) -> Guide:
        """Loop: a ``Guide`` for one request (checked in the sandbox and compiled in the
        cache's threads on a miss)."""
        key = spec.key
        hit = self._lookup(key)
        if hit is None:
            pending = self._pending.get(key)
            if pending is None:
                pending = _Pending(asyncio.ensure_future(self._build(spec)))
                self._pending[key] = pending
                pending.task.add_done_callback(lambda t, key=key: self._settle(key, t))
            pending.waiters += 1
            try:
                # NOTE: shielded: one waiter going away cancels neither the build nor the
                # other waiters; the last one going away cancels the build
                hit = await asyncio.shield(pending.task)
            except asyncio.CancelledError:
                pending.waiters -= 1
                if pending.waiters == 0 and not pending.task.done():
                    pending.task.cancel()  # (the sandbox kills its helper)
                raise
            pending.waiters -= 1
        else:
            self.hits += 1
        if isinstance(hit, _CompileError):
            raise InvalidRequestError(hit.message(spec), field=spec.field)
        lanes: _Lanes = hit
        while min(lanes.live) > 0:  # every lane busy: wait for one more (up to ``lanes``)
            if len(lanes.matchers) + len(lanes.compiling) < self.lanes and not lanes.stuck:
                self._grow(lanes)
            if not lanes.compiling:
                break
            # NOTE: wait() leaves the compiles alone when this request goes away
            await asyncio.wait(lanes.compiling, return_when=asyncio.FIRST_COMPLETED)
        ident, matcher, seat = lanes.take()
        return Guide(matcher.deep_copy(), spec, ident, seat)

    def _settle(self, key: tuple[str, str], task: asyncio.Future) -> None:
        self._pending.pop(key, None)
        if not task.cancelled() and task.exception() is None:
            entry = task.result()
            if not (isinstance(entry, _CompileError) and not entry.keep):
                self._store(key, entry)

    async def _build(self, spec: StructuredOutput) -> Any:
        """The cache entry of a new constraint: its ``_Lanes`` (first lane compiled), or the
        ``_CompileError`` that refuses it (kept: the same input is refused without a compile).
        Raises ``EngineError`` when the sandbox cannot run (not the constraint's fault)."""
        digest = _digest(spec)
        known = self._refused.get(digest)
        if known is not None:
            self._refused.move_to_end(digest)
            return known
        refused = await self._check(spec, digest)
        if isinstance(refused, _CompileError) and refused.keep:
            self._refused[digest] = refused
            while len(self._refused) > REFUSED_KEPT:
                self._refused.popitem(last=False)
        return refused

    async def _check(self, spec: StructuredOutput, digest: str) -> Any:
        """``_build`` for a constraint not refused before."""
        t0 = time.perf_counter()
        try:
            checked = await self.sandbox.check(spec.kind, spec.value, self.compile_timeout_s)
        except SandboxUnavailable as e:
            raise EngineError(f"structured output is unavailable: {e}") from None
        except SandboxCrash as e:
            self.refused += 1
            log.warning(
                "grammar_refused", reason="crash", how=e.how, field=spec.field, kind=spec.kind,
                constraint_sha256=digest, constraint_bytes=len(spec.value),
            )  # fmt: skip
            return _CompileError(
                f"the constraint is refused: it crashed the grammar compiler ({e.how})", own=True
            )
        except SandboxTimeout as e:
            self.refused += 1
            log.warning(
                "grammar_refused", reason="timeout", field=spec.field, kind=spec.kind,
                constraint_sha256=digest, constraint_bytes=len(spec.value),
            )  # fmt: skip
            # NOTE: not remembered: the same input may fit the budget on a less busy machine
            return _CompileError(f"{e} ({TIMEOUT_FLAG})", own=True, keep=False)
        except SandboxError as e:
            return _CompileError(str(e))
        if checked.nbytes > self.cache_bytes:
            self.refused += 1
            return _CompileError(
                f"its compiled grammar needs {checked.nbytes / 2**20:.0f} MiB, more than the "
                f"grammar cache holds ({self.cache_bytes / 2**20:.0f} MiB, {BYTES_FLAG})",
                own=True,
            )
        loop = asyncio.get_running_loop()
        try:
            matcher = await loop.run_in_executor(self._pool, self.compile, checked.grammar)
        except _CompileError as e:  # (not expected: the sandbox compiled the same text)
            return e
        self.compile_s.append(time.perf_counter() - t0)
        return _Lanes(checked.grammar, checked.nbytes, (next(self._ids), matcher))

    def _grow(self, lanes: _Lanes) -> None:
        """Loop: compile one more lane in a compile thread (~1 ms)."""

        def lane() -> llguidance.LLMatcher:
            t0 = time.perf_counter()
            matcher = self.compile(lanes.grammar)
            self.lane_s.append(time.perf_counter() - t0)
            return matcher

        def done(f: asyncio.Future) -> None:  # (before the waiters wake: added first)
            lanes.compiling.discard(f)
            if not f.cancelled() and f.exception() is None:
                lanes.add((next(self._ids), f.result()))
                if any(v is lanes for v in self._cache.values()):
                    self.nbytes += lanes.nbytes
                    self._trim()
            else:
                lanes.stuck = True  # (not expected: the first lane compiled) no more lanes

        fut = asyncio.get_running_loop().run_in_executor(self._pool, lane)
        lanes.compiling.add(fut)
        fut.add_done_callback(done)


class _Pending:
    """A constraint's build in progress and how many requests wait on it."""

    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Future) -> None:
        self.task = task
        self.waiters = 0


def _weight(entry: Any) -> int:
    if isinstance(entry, _Lanes):
        return entry.nbytes * len(entry.matchers)
    return 0


def _digest(spec: StructuredOutput) -> str:
    """What refused constraints are remembered and logged by (never the text: it is request
    content)."""
    return hashlib.sha256(f"{spec.kind}\0{spec.value}".encode()).hexdigest()[:32]


def _lower_priority(barrier: threading.Barrier) -> None:
    """A compile thread: nice 10 (Linux: per thread), so the step thread and the event loop go
    first where CPUs are short; then wait until every thread of the pool exists."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    barrier.wait()


def _compile_pool(threads: int) -> ThreadPoolExecutor:
    """The compile threads, each with a ``COMPILE_STACK_BYTES`` stack (set at their creation:
    every thread is started here, each held at a barrier until all exist)."""
    barrier = threading.Barrier(threads + 1)
    with _STACK_LOCK:
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            pool = ThreadPoolExecutor(threads, thread_name_prefix="loraplex-grammar")
            for _ in range(threads):
                pool.submit(_lower_priority, barrier)
        finally:
            threading.stack_size(old)
    barrier.wait()
    return pool


_STACK_LOCK = threading.Lock()


class _Lanes:
    """Independently compiled matchers of one constraint, (id, matcher); a request takes the
    lane with the fewest live requests (its ``_Seat`` frees the place when the request's
    ``Guide`` goes)."""

    __slots__ = ("compiling", "grammar", "live", "matchers", "nbytes", "stuck")

    def __init__(self, grammar: str, nbytes: int, first: tuple[int, Any]) -> None:
        self.grammar = grammar  # llguidance's text, checked in the sandbox (lanes compile it)
        self.nbytes = nbytes  # the heap of one matcher, as the sandbox measured it
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
    """Why a constraint does not compile: llguidance's reason, or (``own``) the sandbox's
    verdict, a sentence of its own."""

    def __init__(self, reason: str, own: bool = False, keep: bool = True) -> None:
        super().__init__(reason)
        self.own = own
        self.keep = keep  # remembered (the same input is refused again without a compile)

    def message(self, spec: StructuredOutput) -> str:
        if self.own:
            return f"{spec.field}: {str(self).strip()}"
        return _message(spec, str(self))


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
