"""The ``loraplex`` command: a registry of subcommands (serve, digest, bench, ...).

A subcommand is a module exposing ``COMMAND: Subcommand``; add one to ``BUILTIN_COMMANDS`` or
call ``register`` before ``main``. Modules are imported when the parser is built, so they keep
heavy imports (torch, the engine) inside their ``run`` function. ``loraplex bench`` is built
here from the studies of ``loraplex.engine.bench``, which never import this module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from loraplex.engine.server.subcommand import Subcommand

__all__ = ["Subcommand", "BUILTIN_COMMANDS", "register", "build_parser", "main"]


BUILTIN_COMMANDS = {
    "serve": "loraplex.engine.server.launch",
    "digest": "loraplex.engine.server.digest_cmd",
    "serve-ray": "loraplex.engine.serve_ray.launch",
}
_EXTRA: dict[str, Subcommand] = {}


def register(command: Subcommand) -> None:
    """Add (or replace) a subcommand, e.g. ``loraplex bench``."""
    _EXTRA[command.name] = command


def _commands() -> dict[str, Subcommand]:
    found = {name: importlib.import_module(mod).COMMAND for name, mod in BUILTIN_COMMANDS.items()}
    found["bench"] = _bench_command()
    found.update(_EXTRA)
    return found


def _benches() -> dict[str, ModuleType]:
    """The studies of ``loraplex bench``: modules with ``HELP``, ``DESCRIPTION``,
    ``add_arguments(parser)`` and ``run(args) -> int`` (import-light until ``run``)."""
    from loraplex.engine.bench.coldload import cli as coldload

    return {"coldload": coldload}


def _bench_command() -> Subcommand:
    benches = _benches()

    def add_arguments(p: argparse.ArgumentParser) -> None:
        sub = p.add_subparsers(dest="bench", metavar="BENCH")
        sub.required = True
        for name, study in benches.items():
            q = sub.add_parser(
                name, help=study.HELP, description=study.DESCRIPTION, formatter_class=_Formatter
            )
            study.add_arguments(q)
            q.set_defaults(_bench_run=study.run)

    def run(args: argparse.Namespace) -> int:
        return int(args._bench_run(args) or 0)

    return Subcommand(
        name="bench",
        help=f"benchmark studies ({', '.join(benches)}; extra: pip install -e '.[bench]' in a checkout)",
        add_arguments=add_arguments,
        run=run,
    )


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
