r"""An upper bound on a regex's backtracking work, to admit the regexes of an untrusted
``adapter_config.json`` (``peft_config.py``).

Every regex in the file comes from an untrusted file and is run by Python's backtracking
``re``, one C call holding the GIL: ``(.*){8}z`` takes tens of seconds against one module name
and stops every other thread. ``regex_work`` bounds the steps of one match against a name of
``MAX_MODULE_NAME_CHARS`` characters; a pattern is admitted when that bound is at most
``MAX_REGEX_STEPS``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings
from collections.abc import Iterator
from typing import Any

try:  # Python >= 3.11
    from re import _constants as _sre
    from re import _parser as _sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = [
    "MAX_MODULE_NAME_CHARS",
    "MAX_REGEX_CHARS",
    "MAX_REGEX_GROUPS",
    "MAX_REGEX_STEPS",
    "compiled",
    "fullmatch",
    "regex_work",
]

# Bounds on the regexes of an adapter_config.json. Module names matched here are
# ``model.layers.<n>.self_attn.<module>`` and the like (33 characters at layer 999).
MAX_MODULE_NAME_CHARS = 48
# Upper bound of backtracking steps per match (``regex_work``; measured 40-100 ns a step on a
# CPU core, so at most ~10 ms a match, off the event loop). ``.*\.(q_proj|v_proj)`` is ~6e2,
# ``.*language_model.*\.(q_proj|v_proj)`` ~3e4, ``.*\.layers\.(0|1|...|11)\..*(q|v)_proj``
# ~8e4; ``.*.*.*z`` (~4e5) and ``(.*){8}z`` (~1e14, tens of seconds per name) are refused.
MAX_REGEX_STEPS = 100_000
MAX_REGEX_CHARS = 4096
MAX_REGEX_GROUPS = 100  # also bounds the nesting depth the parser recurses into
_WORK_CAP = 10**15
_LOCAL_I = re.compile(r"\(\?[a-zA-Z-]*i")
_ONE_STEP = {_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.AT}
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT}
_POSSESSIVE = getattr(_sre, "POSSESSIVE_REPEAT", None)  # Python >= 3.11
_ATOMIC = getattr(_sre, "ATOMIC_GROUP", None)


def regex_work(pattern: str, n: int) -> int:
    """Upper bound on the steps a backtracking matcher takes to match ``pattern`` from one
    position of a string of at most ``n`` characters, whatever the outcome.

    Each node has P (how many ways it can end, i.e. continuations the rest of the pattern is
    tried from) and W (work to enumerate them). In a sequence the work of an element is paid
    once per way the elements before it can end; a branch adds its alternatives (only those
    that can get past a distinct first literal); a repeat of ``k`` iterations multiplies (past
    its minimum count at most ``n + 1`` iterations: one that matches empty ends the loop).
    Lookarounds and atomic groups end one way.
    Backreferences are refused (ValueError). Values saturate at ``_WORK_CAP``.
    """
    with _quiet():
        parsed = _sre_parse.parse(pattern)
    # NOTE: under IGNORECASE different literals may match one character: no exclusion then
    flags = getattr(getattr(parsed, "state", None), "flags", re.IGNORECASE)
    exclusive = not (flags & re.IGNORECASE or _LOCAL_I.search(pattern))
    p, w = _seq_work(parsed, n, exclusive)
    return min(_WORK_CAP, w + p)


def _seq_work(items: Any, n: int, excl: bool) -> tuple[int, int]:
    paths, work = 1, 0
    for op, av in items:
        p, w = _node_work(op, av, n, excl)
        work = min(_WORK_CAP, work + paths * w)
        paths = min(_WORK_CAP, paths * p)
    return paths, work


def _node_work(op: Any, av: Any, n: int, excl: bool) -> tuple[int, int]:
    if op in _ONE_STEP:
        return 1, 1
    if op is _sre.SUBPATTERN:
        return _seq_work(av[-1], n, excl)
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return 1, _seq_work(av[1], n, excl)[1]
    if _ATOMIC is not None and op is _ATOMIC:
        return 1, _seq_work(av, n, excl)[1]
    if op is _sre.BRANCH:
        # alternatives that start with different literals exclude each other: at most one
        # group of them (plus those starting otherwise) gets past its first character
        groups: dict[Any, list[tuple[int, int]]] = {}
        other: list[tuple[int, int]] = []
        for alt in av[1]:
            first = alt[0] if len(alt) else (None, None)
            pw = _seq_work(alt, n, excl)
            exclusive = excl and first[0] is _sre.LITERAL
            (groups.setdefault(first[1], []) if exclusive else other).append(pw)
        paths, work = 0, 0
        for g in groups.values() or [[]]:
            paths = max(paths, sum(p for p, _ in g + other))
            work = max(work, sum(w for _, w in g + other))
        return min(_WORK_CAP, paths), min(_WORK_CAP, work + len(av[1]))
    if op in _REPEATS or (_POSSESSIVE is not None and op is _POSSESSIVE):
        lo, hi, body = av
        p, w = _seq_work(body, n, excl)
        w = max(w, 1)  # an iteration costs a step even when its body is empty
        # NOTE: the first ``lo`` iterations all run (even empty ones); past them an iteration
        # that consumes nothing ends the loop, so at most n + 1 more
        hi = min(hi, lo + n + 1)
        if p == 1:
            paths, work = hi - lo + 1, 1 + hi * w
        else:
            paths, work, reach = 0, 1, 1  # reach: ways to have done k iterations
            for k in range(hi + 1):
                if k >= lo:
                    paths = min(_WORK_CAP, paths + reach)
                if k < hi:
                    work = min(_WORK_CAP, work + reach * w)
                reach = min(_WORK_CAP, reach * p)
                if work >= _WORK_CAP:
                    break
        return (1 if op is _POSSESSIVE else paths), work
    raise ValueError(f"{op} is not supported here (e.g. backreferences)")


_QUIET = threading.RLock()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Python's regex parser without its FutureWarnings (``[[``, ``--`` ...: syntax a later
    Python may read otherwise): an adapter's pattern is data, its oddities no log lines. The
    warning filters are global: one thread at a time changes them."""
    with _QUIET, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@functools.lru_cache(maxsize=1024)
def compiled(pattern: str) -> re.Pattern[str]:
    """``re.compile(pattern)``, quietly (``_quiet``), once per pattern."""
    with _quiet():
        return re.compile(pattern)


@functools.lru_cache(maxsize=8192)
def fullmatch(pattern: str, name: str, anchored_end: bool = True) -> bool:
    """``re.fullmatch`` (or ``re.match`` for patterns that anchor themselves), remembered: the
    loaders ask about the same (pattern, module name) several times, and a pattern just under
    ``MAX_REGEX_STEPS`` may cost milliseconds a match. Only for admitted patterns."""
    rx = compiled(pattern)
    m = rx.fullmatch(name) if anchored_end else rx.match(name)
    return m is not None
