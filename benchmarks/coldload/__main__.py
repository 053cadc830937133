"""``python -m benchmarks.coldload [flags]``: the same as ``loraplex bench coldload``."""

from __future__ import annotations

import sys

from loraplex.engine.bench.coldload.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks.coldload"))
