"""Chained, collision-resistant hashes of full KV blocks.

A block's hash covers its parent's hash, its token ids and the adapter identity, so equal
hashes mean "same tokens from position 0 up to the end of this block, same adapter (name
and content digest)". The encoding is length-prefixed and unambiguous; the digest is
SHA-256, never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

__all__ = ["AdapterKey", "BlockHash", "encode_adapter", "hash_block", "iter_block_hashes"]

AdapterKey = tuple[str, str] | None  # (adapter name, content digest); None = base model
BlockHash = bytes

_BASE = b"B"  # base model marker
_LORA = b"L"  # adapter marker, followed by length-prefixed name and digest
_ROOT = b"R"  # first block of a sequence
_CHILD = b"C"  # followed by the 32-byte parent hash


def _lp(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def encode_adapter(adapter: AdapterKey) -> bytes:
    """Stable byte encoding of an adapter identity. Raises ``TypeError`` on a bad shape."""
    if adapter is None:
        return _BASE
    if (
        not isinstance(adapter, tuple)
        or len(adapter) != 2
        or not all(isinstance(part, str) for part in adapter)
    ):
        raise TypeError(f"adapter must be None or a (name, digest) tuple of str, got {adapter!r}")
    return _LORA + _lp(adapter[0]) + _lp(adapter[1])


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], adapter_bytes: bytes
) -> BlockHash:
    """Hash one block; ``adapter_bytes`` comes from :func:`encode_adapter`."""
    h = hashlib.sha256()
    h.update(_ROOT if parent is None else _CHILD + parent)
    h.update(adapter_bytes)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return h.digest()


def iter_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    adapter: AdapterKey,
    num_blocks: int | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
) -> Iterator[BlockHash]:
    """Yield the chained hashes of full blocks ``start, start + 1, ...`` of ``token_ids``.

    Stops after ``num_blocks`` blocks (default: every full block). ``parent`` is the hash
    of block ``start - 1`` (``None`` when ``start == 0``). Lazy, so a lookup can stop at
    the first miss.
    """
    if (start == 0) != (parent is None):
        raise ValueError("parent must be given exactly when start > 0")
    adapter_bytes = encode_adapter(adapter)
    full = len(token_ids) // block_size
    end = full if num_blocks is None else min(full, num_blocks)
    for i in range(start, end):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], adapter_bytes)
        yield parent
