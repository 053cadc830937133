"""``python -m benchmarks.coldload [flags]`` (the same as ``loraplex bench coldload``)."""

from __future__ import annotations

import sys

from benchmarks.coldload.cli import main

if __name__ == "__main__":
    sys.exit(main())
