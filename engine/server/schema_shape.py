"""The shape of a JSON Schema: every keyword this module knows holds a value of its kind.

A tool's ``parameters`` is shown to the model under ``tool_choice: "auto"`` and compiled into a
grammar only for ``required`` or a named function, so a malformed schema (``{"type": 5}``,
``{"properties": []}``) would pass unnoticed in the first case and fail only in the second.
This check refuses it up front, as OpenAI does. It is structural only: keywords it does not
know are left alone (JSON Schema allows them), and what a schema means is the grammar
compiler's business.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplex.engine.server.fields import field_path

__all__ = ["schema_problem"]

TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
_SCHEMA = ("additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if",
           "then", "else", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")  # non-empty
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")  # fmt: skip
_NUMBERS = ("minimum", "maximum")
_TEXTS = ("pattern", "format", "$ref", "title", "description", "$id", "$schema", "$anchor")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _type(v: Any) -> bool:
    names = v if isinstance(v, list) and v else [v]
    return all(isinstance(t, str) and t in TYPES for t in names)


# keyword -> (is its value well-shaped, what it must be); the schemas it holds are checked by
# the walk (``_children``)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "type": (_type, f"must be one of {', '.join(sorted(TYPES))} or a non-empty list of them"),
    **{k: (lambda v: isinstance(v, (dict, bool)), "must be a schema (an object or a boolean)")
       for k in _SCHEMA},
    "items": (lambda v: isinstance(v, (dict, bool, list)), "must be a schema or a list of them"),
    **{k: (lambda v: isinstance(v, dict), "must be an object of schemas") for k in _SCHEMA_MAPS},
    **{k: (lambda v: isinstance(v, list) and bool(v), "must be a non-empty list of schemas")
       for k in _SCHEMA_LISTS},
    "prefixItems": (lambda v: isinstance(v, list), "must be a list of schemas"),
    "required": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                 "must be a list of property names"),
    "enum": (lambda v: isinstance(v, list), "must be a list of values"),
    **{k: (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
           "must be a non-negative integer") for k in _COUNTS},
    **{k: (_number, "must be a number") for k in _NUMBERS},
    # (draft 4: a boolean)
    **{k: (lambda v: _number(v) or isinstance(v, bool), "must be a number")
       for k in ("exclusiveMinimum", "exclusiveMaximum")},
    "multipleOf": (lambda v: _number(v) and v > 0, "must be a number above 0"),
    **{k: (lambda v: isinstance(v, str), "must be a string") for k in _TEXTS},
    "uniqueItems": (lambda v: isinstance(v, bool), "must be a boolean"),
}  # fmt: skip


def _children(key: str, v: Any, path: str) -> list[tuple[Any, str]]:
    """The schemas a (well-shaped) keyword value holds, with their paths."""
    if key in _SCHEMA or (key == "items" and not isinstance(v, list)):
        return [(v, path)]
    if key in _SCHEMA_MAPS:
        return [(s, field_path(path, k)) for k, s in v.items()]
    if key in _SCHEMA_LISTS or key in ("prefixItems", "items"):
        return [(s, field_path(path, i)) for i, s in enumerate(v)]
    return []


def schema_problem(schema: Any, param: str) -> str | None:
    """The first shape problem of ``schema`` as "<path> <what is wrong>" (None: well-shaped).
    Iterative; the depth is bounded by the caller (``check_depth``)."""
    stack = [(schema, param)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"{path} must be a schema (an object or a boolean)"
        for key, v in node.items():
            where = field_path(path, key)
            rule = _RULES.get(key)
            if rule is not None and not rule[0](v):
                return f"{where} {rule[1]}"
            stack.extend(_children(key, v, where))
    return None
