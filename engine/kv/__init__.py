"""Paged KV-cache bookkeeping: block ids, block tables and the prefix cache (no torch)."""

from __future__ import annotations

from .block_hash import AdapterKey, BlockHash
from .block_manager import (
    BlockManager,
    BlockManagerError,
    DuplicateRequestError,
    NoFreeBlocksError,
    PrefixCacheStats,
    UnknownRequestError,
)

__all__ = [
    "AdapterKey",
    "BlockHash",
    "BlockManager",
    "BlockManagerError",
    "DuplicateRequestError",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "UnknownRequestError",
]
