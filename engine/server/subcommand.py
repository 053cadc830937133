"""What a ``loraplex`` subcommand is (cli.py keeps the registry; the subcommand modules it
imports by name, e.g. launch.py, import this and never cli.py)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Subcommand"]


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the exit status
    description: str | None = None
