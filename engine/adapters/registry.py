"""Adapter registry and residency: versions, the CPU tier, and who may take GPU slots.

Identity is (name, digest). Re-adding a name with new content makes a new version; requests
already holding the old version finish on it. Tiers:

    CPU tier  (max_cpu_loras)  parsed tensors, pinned when serving on CUDA
    GPU slots (max_loras)      slot buffers inside every LoRA layer; slots 0..max_full-1 also
                               hold full tables (model/lora/full.py), the only ones an adapter
                               with modules_to_save tables takes

Each tier gives up idle entries by its own eviction policy instance (adapters/eviction.py,
``EngineConfig.adapter_eviction``; default LRU): every use of a version touches both (through
the slot store's ``use``), a finished load touches the CPU tier's with what the load cost, and
a version that leaves (unloaded, collected) is forgotten by them.

A version in a GPU slot stays in the CPU tier. The slots themselves (which version holds
which, references, writes) are the slot store's (slot_store.py), which the registry holds:
it frees a forgotten version's slot, skips slot holders when it trims the CPU tier, and
counts an eviction when the store takes a slot from one version for another.

A combination (per-request composition, ``combination``) is a version of its own whose
``parts`` are (component version, weight) pairs: identity = names + digests + weights, one
slot of the summed rank, cached while every component is the current version of its name
(at most ``MAX_COMBINATIONS`` idle ones are kept); it is never listed under a name.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from loraplex.engine.adapters.eviction import EvictionPolicy, tier_policy
from loraplex.engine.adapters.slot_store import SlotFullError, SlotStore
from loraplex.engine.adapters.version import (
    AdapterState,
    AdapterVersion,
    _combination_digest,
    combination_name,
)
from loraplex.engine.adapters.version_index import VersionIndex
from loraplex.engine.errors import AdapterNotFoundError

__all__ = [
    "AdapterRegistry",
    "AdapterVersion",
    "AdapterState",
    "SlotFullError",
    "combination_name",
    "MAX_COMBINATIONS",
]

# Combinations kept in the registry beyond those in use (each is a small object; its tensors
# follow the CPU-tier rules like any version's).
MAX_COMBINATIONS = 64


Loader = Callable[[AdapterVersion], "Any"]  # async: fills version.adapter (and timings)


class AdapterRegistry:
    """Versions and their CPU-tier residency (event loop only); ``slots``: the GPU slots.

    The engine core calls: ``new_version`` / ``register`` / ``unregister`` / ``forget`` /
    ``pin`` / ``get`` / ``names`` / ``versions`` (registry); ``add_user`` (a request starts
    using a version; starts its load if needed); ``make_room`` (the loader needs host
    memory) and ``reset_failed`` (after a failed load's waiters were failed). The scheduler
    calls ``ensure_loaded`` and ``drop_user`` (the request ended), and the slot store for
    slots. ``loader`` is the async load itself; ``on_change`` is called when a load ends
    (either way), ``on_drop`` when a version is forgotten, ``on_unload`` when its CPU-tier
    tensors are dropped, ``on_room`` when host memory may have come free for a load waiting
    for it (a CPU-tier version became evictable, or one was unloaded). ``slots``: the engine's
    slot store (default: one of ``max_loras`` slots that cannot write, for tests of the
    registry alone); ``eviction``: the CPU tier's policy (``tier_policy``; default LRU).
    """

    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        loader: Loader,
        max_full: int = 0,
        on_change: Callable[[], None] = lambda: None,
        on_drop: Callable[[AdapterVersion], None] = lambda v: None,
        on_unload: Callable[[AdapterVersion], None] = lambda v: None,
        on_room: Callable[[], None] = lambda: None,
        slots: SlotStore | None = None,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        # slots 0..max_full-1 also hold full tables (model/lora/full.py): the only ones an adapter
        # with modules_to_save tables may take; other adapters take them last
        self.max_full = max_full
        self._loader = loader
        self._on_change = on_change
        self._on_drop = on_drop
        self._on_unload = on_unload
        self._on_room = on_room
        self._current: dict[str, AdapterVersion] = {}
        self._index = VersionIndex()  # the versions still alive (version_index.py)
        self.slots = slots if slots is not None else SlotStore(max_loras, max_full)
        self.slots.pinned, self.slots.on_taken = self._pinned, self._taken
        self.slots.on_use = self._touch
        self.eviction = eviction if eviction is not None else tier_policy()
        self._combos: dict[str, AdapterVersion] = {}  # digest -> combination version
        self._counter = itertools.count(1)
        self.stats = {
            "gpu_hits": 0,
            "cpu_hits": 0,
            "misses": 0,
            "load_failures": 0,
            "loads": 0,
            "load_cancels": 0,  # loads cancelled (every request waiting on them went)
            "gpu_evictions": 0,
            "cpu_evictions": 0,
        }

    # -- registry -------------------------------------------------------------------------------

    def new_version(self, name: str, uri: str, *, dynamic: bool = False) -> AdapterVersion:
        """A version not registered yet (its digest is known once fetched)."""
        return AdapterVersion(name, uri, "", next(self._counter), dynamic=dynamic)

    def register(self, v: AdapterVersion) -> AdapterVersion:
        """Make ``v`` the current version of its name; an equal (name, digest) one is kept."""
        cur = self._current.get(v.name)
        if (
            cur is not None
            and v.digest
            and cur.digest == v.digest
            and cur.state is not AdapterState.FAILED
        ):
            if v is not cur:
                self._on_drop(v)
            return cur
        if cur is not None:
            v.pinned = v.pinned or cur.pinned  # the operator pinned the name, not a version
            self._index.mark_stale(cur)
        self._current[v.name] = v
        self._index.add(v)
        self._collect()
        return v

    def unregister(self, name: str) -> None:
        """Remove ``name``; its version lives on while requests use it."""
        v = self._current.pop(name, None)
        if v is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded", field="lora_name")
        self._index.mark_stale(v)
        self._collect()

    def forget(self, v: AdapterVersion) -> None:
        """Drop a version from the registry if it is still the current one for its name."""
        if self._current.get(v.name) is v:
            del self._current[v.name]
            self._index.mark_stale(v)
        self._collect()

    def pin(self, name: str, pinned: bool = True) -> None:
        """Operator pin: the adapter keeps its GPU slot once it has one."""
        self.get(name).pinned = pinned

    def get(self, name: str) -> AdapterVersion:
        """The current version of ``name`` (AdapterNotFoundError if none)."""
        v = self._current.get(name)
        if v is None:
            raise AdapterNotFoundError(f"adapter {name!r} does not exist", field="model")
        return v

    def combination(self, parts: list[tuple[AdapterVersion, float]]) -> AdapterVersion:
        """The combination version of ``parts`` (current versions with known digests), made
        once and cached by its identity (names + digests + weights)."""
        key = tuple((v, float(w)) for v, w in parts)
        assert key and all(v.digest and not v.parts for v, _ in key)
        digest = _combination_digest(key)
        v = self._combos.get(digest)
        if v is None:
            name = combination_name([(c.name, w) for c, w in key])
            v = AdapterVersion(name, "", digest, next(self._counter), parts=key)
            v.lora_rank = sum(c.lora_rank for c, _ in key)
            self._combos[digest] = v
            self._index.add(v, stale=True)
            self._collect()
        return v

    def names(self) -> list[str]:
        """Names with a current version."""
        return list(self._current)

    def versions(self) -> list[AdapterVersion]:
        """Every live version (current ones and superseded ones still in use)."""
        return list(self._index.alive.values())

    def _live_combos(self) -> set[int]:
        """Combinations worth keeping: every component current, within ``MAX_COMBINATIONS``
        (the least recently used idle ones beyond it go)."""
        ok = [
            c
            for c in self._combos.values()
            if all(self._current.get(p.name) is p for p, _ in c.parts)
        ]
        idle = sorted(
            (
                c
                for c in ok
                if c.users == 0
                and self.slots.slot_of(c) is None
                and c.state is not AdapterState.LOADING
            ),
            key=lambda c: c.last_used,
        )
        drop = set(map(id, idle[: max(0, len(ok) - MAX_COMBINATIONS)]))
        return {id(c) for c in ok if id(c) not in drop}

    def _collect(self) -> None:
        """Forget superseded versions nobody uses any more (their slot becomes free)."""
        live = self._live_combos()
        stale = self._index.stale
        for v in list(stale.values()):
            if self._current.get(v.name) is v:
                del stale[id(v)]  # current (again): not a candidate
                continue
            if id(v) not in live and v.users == 0 and self.slots.refs(v) == 0:
                if v.parts:
                    self._combos.pop(v.digest, None)
                if v.load_task is not None and v.load_task is not asyncio.current_task():
                    v.load_task.cancel()
                self.slots.free(v)
                self._unload(v)
                self._index.remove(v)
                self._on_drop(v)

    def _set_state(self, v: AdapterVersion, state: AdapterState) -> None:
        """``v.state = state``; every state change goes through here (version_index.py)."""
        self._index.set_state(v, state)

    # -- references -----------------------------------------------------------------------------

    def add_user(self, v: AdapterVersion) -> str:
        """A request starts using ``v``; returns the tier that serves it: gpu, cpu or cold."""
        v.users += 1
        self.slots.use(v)  # last_used and both tiers' policies
        if v.cold_pending:  # loaded for this request before it was tokenized
            v.cold_pending = False
            tier = "cold"
        elif v.state is AdapterState.CPU:
            tier = "gpu" if self.slots.is_ready(v) else "cpu"
        else:
            tier = "cold"
        self.stats[{"gpu": "gpu_hits", "cpu": "cpu_hits", "cold": "misses"}[tier]] += 1
        self.ensure_loaded(v)
        return tier

    def hold(self, v: AdapterVersion) -> None:
        """Keep ``v`` (and its load) alive for a request not submitted yet, without counting
        a hit or a miss; ``drop_user`` lets it go."""
        v.users += 1
        self.ensure_loaded(v)

    def drop_user(self, v: AdapterVersion) -> None:
        """A request of ``v`` ended; the last one cancels a load still running (and lets a
        superseded version go)."""
        assert v.users > 0, f"user count of {v.key} would go negative"
        v.users -= 1
        if v.users == 0 and v.state is AdapterState.LOADING and v.load_task is not None:
            v.load_task.cancel()  # nobody waits for it any more
        if v.parts or self._current.get(v.name) is not v:
            self._collect()  # a superseded version or a combination may go now (a current
            # one stays: scanning every version at every request's end is a loop's cost)
        if v.users == 0:
            self._on_room()  # v may be evictable now

    # -- CPU tier -------------------------------------------------------------------------------

    def ensure_loaded(self, v: AdapterVersion) -> None:
        """Start a background load unless the version is loaded or loading (single-flight)."""
        if v.state in (AdapterState.CPU, AdapterState.LOADING):
            return
        self._set_state(v, AdapterState.LOADING)
        v.error = None
        self.stats["loads"] += 1
        task = asyncio.get_running_loop().create_task(self._load(v))
        v.load_task = task
        task.add_done_callback(lambda t: self._cancelled_unstarted(v, t))

    def _cancelled_unstarted(self, v: AdapterVersion, task: asyncio.Task) -> None:
        """A load task cancelled before its first step never ran ``_load`` (nor its cleanup):
        the version would stay LOADING with a dead task and its next requests wait forever."""
        if v.load_task is task and task.cancelled() and v.state is AdapterState.LOADING:
            v.load_task = None
            self.stats["load_cancels"] += 1
            self._cancelled(v)
            self._on_change()

    def _cancelled(self, v: AdapterVersion) -> None:
        self._set_state(v, AdapterState.REGISTERED)
        self._unload(v)
        if v.dynamic and v.users == 0:  # a request that joined meanwhile keeps the name
            self.forget(v)

    async def _load(self, v: AdapterVersion) -> None:
        try:
            await self._loader(v)
        except asyncio.CancelledError:
            self.stats["load_cancels"] += 1
            self._cancelled(v)
            raise
        except Exception as e:  # noqa: BLE001 - the error is handed to the waiting requests
            self._unload(v)
            self._set_state(v, AdapterState.FAILED)
            v.error = e
            self.stats["load_failures"] += 1
        else:
            self._set_state(v, AdapterState.CPU)
            self._touch(v, time.monotonic())  # (LRU: no change; the others learn the cost)
            self._evict_cpu(keep=v)
        finally:
            v.load_task = None
            self._on_change()
            self._on_room()

    def _touch(self, v: AdapterVersion, now: float) -> None:
        """A use of ``v`` (or its load's end) for the CPU tier's policy: its bytes and what its
        last load cost (its stage timings; None before any)."""
        cost = sum(t for stage, t in v.timings.items() if stage not in ("h2d", "host_wait"))
        self.eviction.touch(v, now=now, size=v.nbytes, cost=cost if cost > 0 else None)

    def _unload(self, v: AdapterVersion) -> None:
        """Drop ``v``'s CPU-tier tensors (its host-pool region goes back, see on_unload); the
        CPU tier's policy forgets it."""
        v.adapter = None
        self.eviction.forget(v)
        self._on_unload(v)
        self._on_room()

    def _evict_cpu(self, keep: AdapterVersion | None, excess: int | None = None) -> int:
        """Evict idle CPU-tier versions beyond ``max_cpu_loras`` (or ``excess`` of them), as
        the tier's policy picks them; returns how many."""
        loaded = list(self._index.cpu.values())
        if excess is None:
            excess = len(loaded) - self.max_cpu_loras
        if excess <= 0:
            return 0
        idle = [
            v for v in loaded if v is not keep and self.slots.slot_of(v) is None and v.users == 0
        ]
        victims = []
        now = time.monotonic()
        for _ in range(min(excess, len(idle))):
            victims.append(self.eviction.victim(idle, now=now))
            idle.remove(victims[-1])
        for v in victims:
            self._unload(v)
            self._set_state(v, AdapterState.REGISTERED)
            self.stats["cpu_evictions"] += 1
        return len(victims)

    def cpu_room(self) -> bool:
        """Whether the CPU tier holds fewer than ``max_cpu_loras`` versions."""
        return len(self._index.cpu) < self.max_cpu_loras

    def admit(self, v: AdapterVersion, adapter: Any) -> bool:
        """add_adapter's pass packed ``v``'s image: ``v`` (registered, current, not loaded)
        joins the CPU tier as if a load had just finished, if the tier has room. A
        registration never pushes a loaded adapter out (registering many adapters into a
        small tier would otherwise pack and throw away all but the last few): without room the
        image is not kept and a request stages it again from the staged copy. Returns whether
        ``v`` joined the tier (the caller gives the image back otherwise)."""
        if self._current.get(v.name) is not v or v.state is not AdapterState.REGISTERED:
            return False
        if not self.cpu_room():
            return False
        now = time.monotonic()
        v.adapter, v.last_used = adapter, now
        self._set_state(v, AdapterState.CPU)
        self._touch(v, now)
        return True

    def evict(self, v: AdapterVersion) -> bool:
        """Drop ``v``'s CPU-tier image now if it is idle (no request, no GPU slot); its next
        request stages it again. Returns whether it was dropped."""
        if v.state is not AdapterState.CPU or v.users or self.slots.slot_of(v) is not None:
            return False
        self._unload(v)
        self._set_state(v, AdapterState.REGISTERED)
        self.stats["cpu_evictions"] += 1
        return True

    def make_room(self) -> bool:
        """Evict one idle CPU-tier version, as the policy picks it (a load needs its host
        memory)."""
        return self._evict_cpu(None, excess=1) > 0

    def reset_failed(self, v: AdapterVersion) -> None:
        """After its waiters were failed, a failed version may be retried by later requests
        (a dynamic one is forgotten, so the next request resolves its name again)."""
        if v.state is AdapterState.FAILED:
            self._set_state(v, AdapterState.REGISTERED)
            if v.dynamic:
                self.forget(v)

    # -- GPU slots (slot_store.py) ----------------------------------------------------------------

    def _taken(self, old: AdapterVersion, new: AdapterVersion) -> None:
        """The slot store gave ``old``'s slot to ``new``: a GPU eviction; ``old`` may leave the
        CPU tier next."""
        self.stats["gpu_evictions"] += 1
        self._evict_cpu(keep=new)
        self._on_room()  # old left its slot: evictable once idle

    def _pinned(self, v: AdapterVersion) -> bool:
        """A pin holds for the current version of its name; a superseded version that is
        draining keeps its slot only while it is referenced."""
        return v.pinned and self._current.get(v.name) is v

    def any_loading(self) -> bool:
        """Some version's load is in flight (the step log records it)."""
        return self._index.num_loading > 0
