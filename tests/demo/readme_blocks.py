"""The README's code blocks, as ``tests/demo/test_readme.py`` runs them.

A fenced block is run unless the line before it (blank lines aside) is a marker
``<!-- readme-test: skip (REASON) -->``: blocks that need a GPU, the network, the Hub, S3 or a
Ray cluster. A marker must name its reason and stand right before a block.

The README talks to a server on 127.0.0.1:8000 and names adapter folders under /srv/adapters;
``localize`` points a block at the test's own server and folders instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "parse_blocks", "localize", "MarkerError"]

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
_SKIP = re.compile(r"^skip \((.+)\)$")


class MarkerError(ValueError):
    """A ``readme-test`` marker that is malformed, has no reason or precedes no block."""


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's info string: bash, python, text, ...
    code: str
    line: int  # 1-based line of the opening fence
    skip: str | None  # the marker's reason, None: the block runs

    @property
    def id(self) -> str:
        return f"line{self.line}-{self.lang or 'text'}"


def parse_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    pending: tuple[int, str] | None = None  # (line, reason) of a marker awaiting its block
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line.strip())
        if marker:
            skip = _SKIP.match(marker.group(1))
            if skip is None or not skip.group(1).strip():
                raise MarkerError(f"line {i + 1}: want '<!-- readme-test: skip (REASON) -->'")
            pending = (i + 1, skip.group(1).strip())
        elif fence := _FENCE.match(line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise MarkerError(f"line {i + 1}: the code block is not closed")
            reason = pending[1] if pending else None
            blocks.append(Block(fence.group(1), "\n".join(lines[i + 1 : end]), i + 1, reason))
            pending = None
            i = end
        elif line.strip() and pending is not None:
            raise MarkerError(f"line {pending[0]}: the marker is not right before a code block")
        i += 1
    if pending is not None:
        raise MarkerError(f"line {pending[0]}: the marker is not right before a code block")
    return blocks


def localize(code: str, *, port: int, adapters: Path, token_file: Path) -> str:
    """``code`` against the test's server (``port``), adapter root and admin token file."""
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    code = code.replace("/srv/adapters", str(adapters))
    code = code.replace("$(cat admin-token)", f"$(cat {token_file})")
    # the example's default URL is port 8000's
    code = code.replace(
        "python examples/openai_client.py",
        f"python examples/openai_client.py --base-url http://127.0.0.1:{port}/v1",
    )
    # the test's interpreter is the environment the README's .venv stands for
    return code.replace(". .venv/bin/activate", ":")
