"""Checks on a JSON schema before it reaches the grammar library: the inputs known to crash it
or to make it answer wrongly are refused here with a reason, not found in the sandbox.

Measured with llguidance 1.9 (tests/structured/test_schema_check.py keeps the cases):
- integer ranges at the 64-bit edges: ``{"type": "integer", "minimum": -2e19, "maximum":
  -1e19}`` and even ``[-2^63 + 1, -2^63 + 2]`` end the process (SIGSEGV); ``[1e19, 2e19]``
  answers ``9223372036854775807``, below its minimum; ``[2^63 - 8, 2^63 - 1]`` allows only the
  last. Bounds anywhere (``allOf`` merges a bound of one branch into another's integer type)
  are therefore held to ±2^53, the range in which JSON numbers are exact (RFC 8259 §6).
- numbers beyond ±2^53 in ``const`` / ``enum`` values: ``{"const": 2**64}`` is answered
  ``18446744073709552000`` (found by the fuzz, benchmarks/fuzz_grammars.py), and so are floats
  there (``4.916144486639031e+16`` as ``49161444866390310``).
- numbers that are not finite (``NaN``, ``Infinity``: Python's JSON reader takes them).
Everything else is the sandbox's (sandbox.py): it contains what no rule here foresaw.
"""

from __future__ import annotations

import math
from typing import Any

from loraplex.engine.errors import InvalidRequestError

__all__ = ["check_schema", "MAX_BOUND"]

MAX_BOUND = 2**53  # |numeric bound| a schema may set (JSON's exact integers)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def check_schema(schema: Any, field: str) -> None:
    """Raise ``InvalidRequestError`` (naming ``field``) for a schema in a known crash or
    wrong-answer class. Iterative: a deep schema cannot exhaust the stack here."""
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:
        node, where = todo.pop()
        if isinstance(node, dict):
            for key in _BOUNDS:
                value = node.get(key)
                if isinstance(value, bool) or value is None:
                    continue  # (draft 4: exclusive bounds are booleans)
                _check_number(value, field, f"{where}/{key}", bound=True)
            if "multipleOf" in node:
                _check_number(node["multipleOf"], field, f"{where}/multipleOf", bound=False)
            for key in ("const", "enum"):
                if key in node:
                    _check_literal(node[key], field, f"{where}/{key}")
            todo.extend((v, f"{where}/{_escape(k)}") for k, v in node.items())
        elif isinstance(node, list):
            todo.extend((v, f"{where}/{i}") for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise _bad(field, where, "is not a finite number")


def _check_number(value: Any, field: str, where: str, *, bound: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(field, where, "must be a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(field, where, "is not a finite number")
    if bound and abs(value) > MAX_BOUND:
        raise _bad(
            field, where,
            f"lies beyond ±2^53 ({MAX_BOUND}), the range in which JSON numbers are exact; "
            "such bounds are not supported",
        )  # fmt: skip
    if not bound and not value > 0:
        raise _bad(field, where, "must be greater than 0")


def _check_literal(value: Any, field: str, where: str) -> None:
    """Numbers in a ``const`` / ``enum`` value (at any depth) within ±2^53."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > MAX_BOUND:
            # (a float there is written as its shortest digits, which read back as another
            # number: {"const": 4.916144486639031e+16} came out 49161444866390310)
            raise _bad(
                field, where,
                f"holds a number beyond ±2^53 ({MAX_BOUND}), which cannot be generated exactly",
            )  # fmt: skip


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")  # JSON Pointer


def _bad(field: str, where: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: the schema's {where or '/'} {what}", field=field)
