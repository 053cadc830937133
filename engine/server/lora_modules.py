"""``--lora-modules``: static adapters named by the operator, parsed and checked.

Shared by the command line (``launch``, which parses the flag) and the app (``app``, which
registers the modules at start-up), so neither imports the other for it. Import-light: the
``loraplex`` parser uses ``parse_lora_module`` for every command.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["LoraModule", "parse_lora_module", "check_lora_modules"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class LoraModule:
    """A static adapter from ``--lora-modules``: operator configuration, not a client choice."""

    name: str
    uri: str
    sha256: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """``name=URI`` or ``{"name": ..., "uri": ..., "sha256": ...}`` (``path`` = ``uri``)."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: bad JSON {text!r}: {e}") from None
        name, uri, sha = obj.get("name"), obj.get("uri", obj.get("path")), obj.get("sha256")
        if not isinstance(name, str) or not isinstance(uri, str) or not name or not uri:
            raise argparse.ArgumentTypeError(
                f"--lora-modules: {text!r} needs string 'name' and 'uri'"
            )
        if sha is not None and not isinstance(sha, str):
            raise argparse.ArgumentTypeError(f"--lora-modules: sha256 of {name!r} is not a string")
        sha = sha.lower().removeprefix("sha256:") if sha else None
        if sha is not None and not _SHA256.match(sha):
            raise argparse.ArgumentTypeError(f"--lora-modules: sha256 of {name!r} is not 64 hex")
        return _named(LoraModule(name, uri, sha))
    name, sep, uri = text.partition("=")
    if not sep or not name or not uri:
        raise argparse.ArgumentTypeError(f"--lora-modules: expected name=URI, got {text!r}")
    return _named(LoraModule(name, uri))


def _named(m: LoraModule) -> LoraModule:
    """The name rule of the admin load route: clients choose adapters by these names."""
    from loraplex.engine.adapters.fetch import valid_adapter_name

    if not valid_adapter_name(m.name):
        raise argparse.ArgumentTypeError(
            f"--lora-modules: bad adapter name {m.name!r} (letters, digits, '._-' and one '/')"
        )
    return m


def check_lora_modules(modules: Sequence[LoraModule], taken: Iterable[str] = ()) -> None:
    """Refuse a name listed twice, or one already taken (the base model, demo adapters)."""
    seen = set(taken)
    for m in modules:
        _named(m)
        if m.name in seen:
            raise ValueError(
                f"--lora-modules: the name {m.name!r} is used twice (or is the base model's name)"
            )
        seen.add(m.name)
