"""An adapter version as the registry tracks it: identity and host-side state (load state, the
CPU tier's tensors and region, users), and the identity of a combination (per-request
composition); ``registry.py`` holds the registry. Which GPU slot a version holds, and
everything about that slot, is the slot store's (slot_store.py)."""

from __future__ import annotations

import asyncio
import enum
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.engine.adapters.parse import LoRAAdapter
from loraplex.engine.model.moe.lora_names import expert_module

__all__ = ["AdapterState", "AdapterVersion", "adapter_has_experts", "combination_name"]


class AdapterState(enum.Enum):
    REGISTERED = "registered"  # known, not in memory
    LOADING = "loading"
    CPU = "cpu"  # tensors in the CPU tier
    FAILED = "failed"


@dataclass(eq=False)
class AdapterVersion:
    name: str
    uri: str
    digest: str
    version: int
    local_dir: Path | None = None
    state: AdapterState = AdapterState.REGISTERED
    adapter: LoRAAdapter | None = None
    error: BaseException | None = None
    users: int = 0  # requests in flight (waiting or running) on this version
    pinned: bool = False  # operator pin: never evicted from its GPU slot
    dynamic: bool = False  # resolved from a name at request time (forgotten if its load fails)
    trusted: bool = False  # an operator-configured source (a fetch again uses the same policy)
    pinned_uri: str | None = None  # the source at the exact revision fetched
    nbytes: int = 0
    progress: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    load_task: asyncio.Task | None = None
    region: Any = None  # host-pool Region holding the CPU-tier tensors (host_pool.py)
    seal: Any = None  # the staged copy's seal (seal.py): a re-stage needs no second hash
    # the staged copy still being written after the load's pass (a concurrent Future of its
    # seal: onepass.py's defer_copy); nothing reads the copy before it is done
    copy: Any = None
    lora_rank: int = 0  # largest module rank, from the preflight (0: not fetched yet)
    dora: bool = False  # a DoRA adapter (preflight)
    full: bool = False  # carries modules_to_save tables (preflight): a full-table slot only
    # carries LoRA on the experts of a MoE base (model/moe/lora_names.py): an expert-capable
    # slot only (``max_expert_loras``)
    experts: bool = False
    vocab_rows: int = 0  # rows of those tables (preflight); > the base's: it added tokens
    tokenizer: Any = None  # its own Tokenizer when it added tokens (added_tokens.py), else None
    # a name resolved at request time whose requests are tokenized after its load (it may add
    # tokens: ``AdapterLifecycle.load_before_tokenizing``); ``cold_pending``: that load counts
    # as the miss of the next request to use it
    tokenize_after_load: bool = False
    cold_pending: bool = False
    # a combination: (component version, weight) in request order (empty: a plain adapter)
    parts: tuple[tuple[AdapterVersion, float], ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.name, self.digest)

    @property
    def rank(self) -> int:
        return self.adapter.rank if self.adapter is not None else 0


def _has_full(v: AdapterVersion) -> bool:
    """``v``'s adapter replaces full embed_tokens / lm_head tables (modules_to_save)."""
    return v.full or bool(getattr(v.adapter, "full", None))


def adapter_has_experts(adapter: object) -> bool:
    """``adapter`` (a LoRAAdapter or slot source) has LoRA on some expert module: its slot
    image's entries, else its weights' keys."""
    image = getattr(adapter, "image", None)
    keys = getattr(image, "entries", None) or getattr(adapter, "weights", None) or {}
    return any(expert_module(k[1]) is not None for k in keys)


def _has_experts(v: AdapterVersion) -> bool:
    """``v``'s adapter has LoRA on the experts (an expert-capable slot only)."""
    return v.experts or (v.adapter is not None and adapter_has_experts(v.adapter))


def combination_name(parts: list[tuple[str, float]]) -> str:
    """Display name of a combination, e.g. ``sql*0.7+pirate*0.3``: ``*`` and ``+`` are never
    in an adapter name, so it cannot collide with one."""
    return "+".join(f"{n}*{float(w)!r}" for n, w in parts)


def _combination_digest(parts: tuple[tuple[AdapterVersion, float], ...]) -> str:
    text = "".join(f"{v.name}\n{v.digest}\n{float(w)!r}\n" for v, w in parts)
    return hashlib.sha256(b"combination\n" + text.encode()).hexdigest()
