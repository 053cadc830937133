"""The ``loraplex`` command: a registry of subcommands (serve, digest, ...).

A subcommand is a module exposing ``COMMAND: Subcommand``; add one to ``BUILTIN_COMMANDS`` or
call ``register`` before ``main``. Modules are imported when the parser is built, so they keep
heavy imports (torch, the engine) inside their ``run`` function.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Subcommand", "BUILTIN_COMMANDS", "register", "build_parser", "main"]


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the exit status
    description: str | None = None


BUILTIN_COMMANDS = {
    "serve": "loraplex.engine.server.launch",
    "digest": "loraplex.engine.server.digest_cmd",
}
_EXTRA: dict[str, Subcommand] = {}


def register(command: Subcommand) -> None:
    """Add (or replace) a subcommand, e.g. ``loraplex bench``."""
    _EXTRA[command.name] = command


def _commands() -> dict[str, Subcommand]:
    found = {name: importlib.import_module(mod).COMMAND for name, mod in BUILTIN_COMMANDS.items()}
    found.update(_source_checkout_commands())
    found.update(_EXTRA)
    return found


def _source_checkout_commands() -> dict[str, Subcommand]:
    """``loraplex bench``: benchmarks/ lives next to engine/ in a source checkout (not installed)."""
    root = Path(__file__).resolve().parents[2]
    if importlib.util.find_spec("benchmarks") is None and (root / "benchmarks").is_dir():
        sys.path.append(str(root))
    with contextlib.suppress(ImportError):
        return {"bench": importlib.import_module("benchmarks.coldload.cli").COMMAND}
    return {}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, [], False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraplex",
        description="Serve one base LLM with many LoRA adapters (OpenAI-compatible API).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, cmd in _commands().items():
        p = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.description or cmd.help,
            formatter_class=_Formatter,
        )
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
