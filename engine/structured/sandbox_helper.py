"""A grammar sandbox process: turns one untrusted constraint at a time into a checked grammar.

Started by ``GrammarSandbox`` (sandbox.py) as ``python -m
loraplex.engine.structured.sandbox_helper --conn-fd N``; the first message on the connection is
the ``SandboxInit``. Each job is ``(kind, value)`` of a ``StructuredOutput``; the reply is
``("ok", Checked)`` or ``("error", message)``. A constraint that crashes the grammar library
(a native fault, a stack overflow, an allocation past the memory limit) ends this process only:
the engine sees the connection close and refuses the constraint.

What a job runs, all of it on untrusted input: the conversion to llguidance's grammar (GBNF ->
Lark is pure Python), the matcher's construction (lexer, parser tables), the first mask, and a
short deterministic walk of allowed tokens (masks and consumed tokens), so lazily built lexer
states are exercised here first. The compile thread's stack is ``STACK_BYTES``, a quarter of the
engine's compile threads' (``grammars.COMPILE_STACK_BYTES``): a recursion that fits here fits
there with room to spare, since the same grammar takes the same path through the same library.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import random
import resource
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Checked", "SandboxInit", "STACK_BYTES", "grammar_text", "main"]

STACK_BYTES = 4 << 20  # the compile thread's stack here (the engine's are 4 x this)
WALKS = 2  # random walks of allowed tokens after the first mask
WALK_TOKENS = 16  # tokens per walk

# JSON as models write it: ", " and ": " between items, no other whitespace (free whitespace
# lets a small model emit newlines until max_tokens)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class SandboxInit:
    tokenizer_json: str
    vocab_size: int  # of the logits (may exceed the tokenizer's)
    eos_ids: tuple[int, ...]
    memory_bytes: int | None  # the process's data limit (RLIMIT_DATA); None: none


@dataclass(frozen=True)
class Checked:
    """A constraint that compiled here: llguidance's grammar text (what the engine compiles
    again, conversion done), the heap its matcher held after the walk, the compile's seconds."""

    grammar: str
    nbytes: int
    seconds: float

    def astuple(self) -> tuple[str, int, float]:
        """What crosses the connection (plain values: the helper runs as ``__main__``)."""
        return (self.grammar, self.nbytes, self.seconds)


class ConstraintError(Exception):
    """The grammar library's reason why a constraint does not compile (a 400)."""


def grammar_text(kind: str, value: str) -> str:
    """llguidance's grammar for a constraint (``StructuredOutput`` kind and value); not yet
    compiled. Raises ``ConstraintError`` for a grammar the converter refuses."""
    import json

    import llguidance

    m = llguidance.LLMatcher
    if kind == "json":
        return m.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return m.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return m.grammar_from_regex(value)
    if kind == "choice":
        options = json.loads(value)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    if kind == "grammar":
        try:  # Lark as is; GBNF / EBNF converted
            return llguidance.grammar_from("grammar", value)
        except (ValueError, RecursionError) as e:
            raise ConstraintError(str(e)) from None
    raise ConstraintError(f"unknown constraint kind {kind!r}")


def build_matcher(tokenizer: Any, grammar: str) -> Any:
    """A matcher for ``grammar`` with its first mask computed (lexer states built); raises
    ``ConstraintError`` when it does not compile or accepts no output at all."""
    import llguidance

    # NOTE: terse errors: verbose ones dump the parser state (request content) into messages
    limits = llguidance.LLParserLimits(verbose_errors=False)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise ConstraintError(matcher.get_error())
    matcher.compute_bitmask()
    if matcher.is_error():  # a constraint that accepts nothing fails at its first mask
        error = matcher.get_error()
        if "NoExtensionBias" in error:
            raise ConstraintError("it accepts no output at all")
        raise ConstraintError(f"it fails at its first token: {error}")
    return matcher


def _allowed(mask: bytes, vocab: int) -> list[int]:
    import numpy as np

    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits).tolist()


def walk(matcher: Any, vocab: int, eos: set[int], seed: int) -> None:
    """Consume up to ``WALKS`` x ``WALK_TOKENS`` allowed tokens (never EOS while another token
    is allowed), a mask before each; each walk on its own copy of ``matcher``."""
    rng = random.Random(seed)
    for _ in range(WALKS):
        m = matcher.deep_copy()
        for _ in range(WALK_TOKENS):
            if m.is_stopped() or m.is_error():
                break
            ok = [t for t in _allowed(m.compute_bitmask(), vocab) if t not in eos]
            if not ok:
                break
            m.consume_token(rng.choice(ok))


def _heap_bytes() -> int:
    """Bytes the C heap hands out now (glibc's mallinfo2), else the resident set size."""
    try:
        libc = ctypes.CDLL(None)

        class _Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost",
            )]  # fmt: skip

        libc.mallinfo2.restype = _Info
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)
    except (AttributeError, OSError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _data_bytes() -> int:
    """This process's data segment now (what RLIMIT_DATA counts)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


class _Worker:
    def __init__(self, conn: Connection, init: SandboxInit) -> None:
        import llguidance

        self.conn = conn
        self.init = init
        eos = list(init.eos_ids) or None
        self.tokenizer = llguidance.LLTokenizer(
            init.tokenizer_json, n_vocab=init.vocab_size, eos_token=eos
        )
        self.eos = set(init.eos_ids)

    def serve(self) -> None:
        while True:
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the engine is gone
            try:
                reply: tuple[str, Any] = ("ok", self.check(kind, value).astuple())
            except ConstraintError as e:
                reply = ("error", str(e))
            except Exception as e:  # noqa: BLE001 - the constraint's fault: the engine says why
                reply = ("error", f"{type(e).__name__}: {e}")
            self.conn.send(reply)

    def check(self, kind: str, value: str) -> Checked:
        t0 = time.perf_counter()
        grammar = grammar_text(kind, value)
        before = _heap_bytes()
        matcher = build_matcher(self.tokenizer, grammar)
        seed = int.from_bytes(hashlib.sha256(f"{kind}\0{value}".encode()).digest()[:8], "little")
        walk(matcher, self.init.vocab_size, self.eos, seed)
        nbytes = max(0, _heap_bytes() - before) + len(grammar)
        seconds = time.perf_counter() - t0
        del matcher
        return Checked(grammar, nbytes, seconds)


def _start(conn: Connection, init: SandboxInit) -> None:
    with contextlib.suppress(OSError):
        os.nice(10)  # where CPUs are short, the engine's step thread and event loop go first
    worker = _Worker(conn, init)  # (the tokenizer's trie first: it is ours, not the input's)
    if init.memory_bytes:
        limit = _data_bytes() + init.memory_bytes
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    conn.send("ready")
    threading.stack_size(STACK_BYTES)
    thread = threading.Thread(target=worker.serve, name="loraplex-grammar-sandbox")
    thread.start()
    thread.join()


def main(argv: list[str] | None = None) -> None:
    """``python -m loraplex.engine.structured.sandbox_helper --conn-fd N`` (started by
    ``GrammarSandbox``, not by multiprocessing's spawn, which would re-import the embedding
    application's ``__main__``)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--conn-fd", type=int, required=True)
    args = ap.parse_args(argv)
    conn = Connection(args.conn_fd)
    init = conn.recv()
    _start(conn, init)


if __name__ == "__main__":
    # NOTE: through the package's module, so what is pickled names it, not ``__main__``
    from loraplex.engine.structured.sandbox_helper import main as _main

    _main()
