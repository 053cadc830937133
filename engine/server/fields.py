"""Text checks the request parsers share: every string that reaches a tokenizer, a template or a
reply must be valid UTF-8, and the 400 for one that is not names the field that holds it
(``messages[1].tool_calls[0].function.name``), however deep in a JSON tree it sits.
"""

from __future__ import annotations

import re
from typing import Any

from loraplex.engine.server.errors import APIError

__all__ = ["utf8", "tree_chars", "field_path"]

_PLAIN_KEY = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$\-]{0,63}$")


def utf8(value: str, param: str) -> str:
    """``value`` if it encodes as UTF-8 (JSON allows lone surrogates such as ``"\\ud800"``)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            msg = f"{param} holds a lone UTF-16 surrogate (not valid Unicode text)"
            raise APIError(400, msg, param=param) from None
    return value


def field_path(parent: str, key: str | int) -> str:
    """``parent[3]`` for a list index, ``parent.name`` for a plain key, ``parent["a b"]``
    otherwise (a key is shown only once it is known to be valid text)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    if _PLAIN_KEY.match(key):
        return f"{parent}.{key}"
    return f"{parent}[{key[:64]!r}]"


# A node's path is kept as (parent path, key) pairs and spelled out only for an error: most
# trees are valid, and a string per node would double the cost of the walk.
_Path = tuple[Any, "str | int"] | str


def _spell(path: _Path) -> str:
    keys: list[str | int] = []
    while not isinstance(path, str):
        path, key = path
        keys.append(key)
    for key in reversed(keys):
        path = field_path(path, key)
    return path


def tree_chars(value: Any, param: str) -> int:
    """Characters of every string (keys included) in a JSON tree, each checked as UTF-8; an
    invalid one is a 400 naming its field (a bad key: the object that holds it)."""
    total = 0
    stack: list[tuple[Any, _Path]] = [(value, param)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                utf8(v, _spell(path))
            total += len(v)
        elif isinstance(v, dict):
            for k, child in v.items():
                if isinstance(k, str):
                    if not k.isascii():
                        utf8(k, _spell(path))
                    total += len(k)
                stack.append((child, (path, k)))
        elif isinstance(v, list):
            stack.extend((child, (path, i)) for i, child in enumerate(v))
    return total
