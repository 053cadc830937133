"""Adapter content digest, as DESIGN.md defines it.

``sha256`` of the text ``sha256sum adapter_config.json adapter_model.safetensors`` prints in
the adapter folder (names sorted, ``"<hex>  <name>\\n"`` per file), i.e. equal to
``sha256sum adapter_config.json adapter_model.safetensors | sha256sum``. Files are streamed in
chunks: adapters can be gigabytes.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from loraplex.engine.errors import AdapterConfigError, AdapterDigestError, AdapterFormatError

__all__ = [
    "DIGEST_FILES",
    "adapter_digest",
    "adapter_digest_async",
    "check_digest",
    "file_sha256",
    "sha256sum_text",
]

DIGEST_FILES = ("adapter_config.json", "adapter_model.safetensors")  # already sorted
CHUNK_BYTES = 1 << 20


def file_sha256(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of one file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def sha256sum_text(folder: str | Path) -> str:
    """The exact text ``sha256sum`` prints for the adapter files of ``folder``."""
    folder = Path(folder)
    lines = []
    for name in sorted(DIGEST_FILES):
        path = folder / name
        if not path.is_file():
            err = AdapterConfigError if name == DIGEST_FILES[0] else AdapterFormatError
            raise err(f"cannot digest {folder}: no {name}", field=name)
        lines.append(f"{file_sha256(path)}  {name}\n")
    return "".join(lines)


def adapter_digest(folder: str | Path) -> str:
    """Hex sha256 digest identifying the adapter's content (blocking; see the async twin)."""
    return hashlib.sha256(sha256sum_text(folder).encode()).hexdigest()


async def adapter_digest_async(folder: str | Path) -> str:
    """``adapter_digest`` in a worker thread, so the event loop never hashes."""
    return await asyncio.to_thread(adapter_digest, folder)


def check_digest(folder: str | Path, expected: str) -> str:
    """Compute the digest and fail closed (AdapterDigestError) unless it equals ``expected``.

    ``expected`` may carry a ``sha256:`` prefix and any case.
    """
    want = expected.strip().lower().removeprefix("sha256:")
    got = adapter_digest(folder)
    if got != want:
        raise AdapterDigestError(
            f"adapter in {folder} has digest {got}, configured sha256 is {want}", field="sha256"
        )
    return got
