"""The adapter side of the engine: one object, ``AdapterLifecycle``, that ``EngineCore`` calls.

It holds the registry (names, versions, the CPU tier), the fetcher (sources and files), the
stager (the stage step), the host pool and the slot store, and does what the core asks of
adapters: add / remove / pin / list them, resolve a request's choice (a name, resolved
dynamically if unknown, or a composition) to a version, load a version (the registry's loader:
fetch, stage, DoRA's row scales, the shards under tensor parallelism), land slot writes
(``land``) and report residency. The core builds it with what this layer may not import (the
slot writer, the runner's slot ranks and shard packing, the adapter tokenizer loader, its event
emitter and wake-up) and keeps the requests: it fails the ones waiting on a failed load or
slot write.

One concept, ~480 lines: the lifecycle of an adapter from its name to its slot (add, resolve,
load, land and residency read each other's state; split, each part would import the rest).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from loraplex.engine.adapters.checks import fold_dora
from loraplex.engine.adapters.eviction import tier_policy
from loraplex.engine.adapters.fetch import AdapterFetcher
from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.parse import LoRAAdapter, load_magnitudes
from loraplex.engine.adapters.registry import AdapterRegistry
from loraplex.engine.adapters.seal import sealed_read
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.adapters.slot_writer import SlotWriter
from loraplex.engine.adapters.version import AdapterState, AdapterVersion, adapter_has_experts
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import (
    AdapterCompositionError,
    AdapterConfigError,
    AdapterNotFoundError,
    InvalidRequestError,
    SlotWriteError,
    StagedCopyChangedError,
)
from loraplex.engine.model.lora.dora import row_scales
from loraplex.engine.model.lora.ranks import SlotRanks
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model.tp import full_config

__all__ = ["AdapterChoice", "AdapterLifecycle", "MAX_COMPOSITION"]

# What a request runs on: None (the base model), an adapter name, or a composition of
# adapters with weights, e.g. [("sql", 0.7), ("pirate", 0.3)].
AdapterChoice = str | Sequence[tuple[str, float]] | None

MAX_COMPOSITION = 16  # adapters in one composition

log = structlog.get_logger("loraplex.engine")


class AdapterLifecycle:
    """Adapters over time (see the module docstring); event loop only.

    ``registry``, ``fetcher``, ``stager``, ``slots`` and ``pool`` are its parts (tests and
    benchmarks reach them through ``AsyncEngine.testing.adapters``).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        *,
        writer: SlotWriter,
        ranks: SlotRanks,
        generation: Callable[[], int],
        pool: HostPool | None = None,
        prepare_shards: Callable[[Any], Any] | None = None,
        emit: Callable[..., None] = lambda event, **data: None,
        wake: Callable[[], None] = lambda: None,
        base_tokenizer: Any = None,
        load_tokenizer: Callable[[Path], Any] | None = None,
    ) -> None:
        self.config = config
        self.model = model  # its dtype and device; its base weights for DoRA's row scales
        self.model_config = full_config(model)  # (model.cfg: a TP rank's shard)
        self.device = model.device
        self.emit = emit
        self._prepare_shards = prepare_shards  # tensor parallelism: every rank's packed shard
        self.fetcher = AdapterFetcher(config, self.model_config, pool=pool)
        # adapters that add tokens bring their own tokenizer (added_tokens.py)
        self.fetcher.base_tokenizer = base_tokenizer
        self.fetcher.load_tokenizer = load_tokenizer
        self.stager = self.fetcher.stager
        self.pool = pool
        # one eviction policy instance per tier, of the configured kind
        self.slots = SlotStore(
            config.max_loras, config.max_full_module_loras, config.max_expert_loras,
            writer=writer, ranks=ranks, pool=pool, generation=generation, eviction=tier_policy(config.adapter_eviction),
        )  # fmt: skip
        self.registry = AdapterRegistry(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            loader=self._load,
            max_full=config.max_full_module_loras,
            on_change=wake,
            on_drop=self.fetcher.discard,
            on_unload=self.stager.release,
            on_room=self.stager.regions.room_changed,
            slots=self.slots,
            eviction=tier_policy(config.adapter_eviction),
        )
        self.stager.regions.make_room = self.registry.make_room
        self._load_gate: asyncio.Semaphore | None = None

    async def close(self) -> None:
        """Cancel loads, stop the slot writer, then the fetcher (loader processes, the staging
        dir, the host pool). The engine's steps have stopped."""
        tasks = [v.load_task for v in self.registry.versions() if v.load_task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.slots.close)
        await asyncio.to_thread(self.fetcher.close)

    # -- the operator's adapters ------------------------------------------------------------------

    async def add(
        self, name: str, uri: str, sha256: str | None, *, trusted: bool = True
    ) -> AdapterVersion:
        """Add an adapter now (fetched, verified and preflighted before it is registered).
        The same pass packs its slot image, which joins the CPU tier as a finished load would
        (``AdapterRegistry.admit``): its first request only writes a slot. Without a free
        host-pool region, or when the CPU tier is full, no image is kept (the first request
        stages it from the verified staging copy; registering never evicts a loaded adapter).

        ``trusted``: operator configuration (``--lora-modules``), allowed verbatim; otherwise
        (runtime admin loads) the source must pass the allowlist policy.
        """
        if self.config.max_loras == 0:
            raise InvalidRequestError("this engine runs with max_loras=0: adapters are disabled")
        if trusted:
            await self.fetcher.allow_static(uri)
        t0 = time.perf_counter()
        v = self.registry.new_version(name, uri)
        v.trusted = trusted
        # the pass packs the image only while the CPU tier has room for it (admit)
        room = self.registry.cpu_room()
        stage = (self.model.dtype, self.device.type == "cuda") if room else None
        adapter = await self.fetcher.fetch_verify(
            v, sha256, trusted=trusted, stage=stage, background=True
        )
        if adapter is not None:
            try:
                await self._finish(v, adapter)
            except BaseException:  # DoRA's checks failed, or the caller is gone
                self.stager.release(v)
                self.fetcher.discard(v)
                raise
        cur = self.registry.register(v)
        if adapter is not None:
            if cur is v and self.registry.admit(v, adapter):
                self.emit(
                    "adapter_load", name=v.name, uri=v.uri, digest=v.digest, ok=True,
                    timings=dict(v.timings), total_s=time.perf_counter() - t0,
                    nbytes=adapter.nbytes,
                )  # fmt: skip
            else:  # an equal version was current (this one went, files too), or no room
                self.stager.release(v)
        await self.fetcher.trim_staging(self.registry.versions, keep=cur)
        return cur

    def remove(self, name: str) -> None:
        self.registry.unregister(name)

    def pin(self, name: str, pinned: bool = True) -> None:
        self.registry.pin(name, pinned)

    def list(self) -> list[dict[str, Any]]:
        out = []
        for name in self.registry.names():
            v = self.registry.get(name)
            out.append({"name": name, "uri": v.uri, "digest": v.digest, "state": v.state.value})
        return out

    def tokenizer_of(self, name: str) -> Any:
        """The tokenizer of adapter ``name`` when it added tokens (known once it is loaded
        ahead), else None."""
        try:
            return self.registry.get(name).tokenizer
        except AdapterNotFoundError:
            return None

    # -- a request's adapter ----------------------------------------------------------------------

    def resolve(self, choice: AdapterChoice) -> AdapterVersion | None:
        """The version a request runs on (None: the base model); typed errors for unknown
        names and bad compositions."""
        if choice is None:
            return None
        if isinstance(choice, str):
            return self.resolve_name(choice)
        return self.resolve_composition(choice)

    def resolve_name(self, name: str) -> AdapterVersion:
        """The current version of ``name``; unknown names go through dynamic resolution."""
        try:
            return self.registry.get(name)
        except AdapterNotFoundError:
            uri = self.fetcher.dynamic_uri(name) if self.config.max_loras else None
            if uri is None:
                raise
        v = self.registry.new_version(name, uri, dynamic=True)
        return self.registry.register(v)

    async def load_before_tokenizing(self, adapter: AdapterChoice) -> None:
        """Where adapters may add tokens (``lora_extra_vocab_size`` > 0), a name resolved at
        request time is loaded before its request is tokenized, so that the request is
        tokenized with the adapter's own tokenizer if it has one (the request would wait for
        this load anyway). A no-op for the base, compositions, names loaded ahead and names
        fetched before (their tokenizer is known). The load's typed error is raised here and
        the name is forgotten, as when a request's load fails; the load counts as the miss of
        the request that uses it next."""
        if not self.config.lora_extra_vocab_size or not isinstance(adapter, str):
            return
        v = self.resolve_name(adapter)  # typed error when nothing resolves the name
        if not v.dynamic or v.digest:
            return
        v.tokenize_after_load = True
        self.registry.hold(v)
        try:
            if v.load_task is not None:
                await asyncio.wait({v.load_task})
        finally:
            self.registry.drop_user(v)
        if v.state is AdapterState.FAILED:
            error = v.error or RuntimeError(f"adapter {v.name!r} failed to load")
            if v.users == 0:
                self.registry.reset_failed(v)  # forgotten: the next request resolves it again
            raise error
        if v.state is AdapterState.CPU:
            v.cold_pending = True

    def resolve_composition(self, parts: Sequence[tuple[str, float]]) -> AdapterVersion:
        """The combination version of ``parts`` (made and cached by the registry); every
        refusal is an AdapterCompositionError and leaves nothing registered or loaded."""

        def bad(msg: str) -> AdapterCompositionError:
            return AdapterCompositionError(msg, field="adapters")

        if self.config.max_loras == 0:
            raise bad("this engine runs with max_loras=0: adapters are disabled")
        if isinstance(parts, (str, bytes)) or not parts:
            raise bad("a composition is a non-empty list of (adapter name, weight) pairs")
        if len(parts) > MAX_COMPOSITION:
            raise bad(f"a composition has at most {MAX_COMPOSITION} adapters, got {len(parts)}")
        versions: list[tuple[AdapterVersion, float]] = []
        for i, part in enumerate(parts):
            try:
                name, weight = part
            except (TypeError, ValueError):
                raise bad(f"adapters[{i}] is not a (name, weight) pair") from None
            if not isinstance(name, str) or isinstance(weight, bool):
                raise bad(f"adapters[{i}]: the name must be a string and the weight a number")
            try:
                weight = float(weight)
            except (TypeError, ValueError):
                raise bad(f"adapters[{i}]: the weight must be a number") from None
            if not math.isfinite(weight):
                raise bad(f"adapters[{i}]: the weight must be finite, got {weight}")
            if any(v.name == name for v, _ in versions):
                raise bad(f"adapter {name!r} appears twice in the composition")
            try:
                v = self.registry.get(name)
            except AdapterNotFoundError:
                raise bad(f"adapter {name!r} in the composition does not exist") from None
            if not v.digest or v.lora_rank == 0 or v.state is AdapterState.FAILED:
                raise bad(
                    f"adapter {name!r} has not been fetched yet: request it alone once before "
                    "composing it"
                )
            if v.dora:
                raise bad(f"adapter {name!r} is a DoRA adapter: DoRA adapters cannot be composed")
            if v.full:
                raise bad(
                    f"adapter {name!r} replaces full embed_tokens / lm_head tables "
                    "(modules_to_save): such adapters cannot be composed"
                )
            versions.append((v, weight))
        rank = sum(v.lora_rank for v, _ in versions)
        if rank > self.config.max_lora_rank:
            ranks = " + ".join(f"{v.lora_rank} ({v.name})" for v, _ in versions)
            raise bad(
                f"the composition's rank {ranks} = {rank} is above max_lora_rank "
                f"{self.config.max_lora_rank}"
            )
        return self.registry.combination(versions)

    def drop_unused(self, v: AdapterVersion) -> None:
        """Forget a dynamic version resolved for a request that was then rejected, unless some
        other request uses it (else made-up names would pile up in the registry)."""
        if v.dynamic and v.users == 0 and v.state is AdapterState.REGISTERED:
            self.registry.forget(v)

    # -- loads (the registry's loader) ------------------------------------------------------------

    async def _load(self, v: AdapterVersion) -> None:
        # NOTE: loads beyond max_concurrent_loads queue here (in loader processes their CPU
        # work is off this process's GIL; in threads it competes with the step thread)
        if self._load_gate is None:
            self._load_gate = asyncio.Semaphore(max(1, self.config.max_concurrent_loads))
        async with self._load_gate:
            await self._load_now(v)

    async def _load_now(self, v: AdapterVersion) -> None:
        t0 = time.perf_counter()
        if "stage" in v.timings:
            v.timings.clear()  # a re-stage must not report an earlier load's stages
        info = {"name": v.name, "uri": v.uri}
        try:
            if v.parts:
                adapter = await self._stage_combination(v)
            else:
                # a version not fetched yet is fetched, checked and staged in one pass
                stage = (self.model.dtype, self.device.type == "cuda")
                adapter = await self._fetched(v, stage)
                if adapter is None:  # its verified copy is staged: packed from there
                    try:
                        adapter = await self.stager.stage(v, stage[0], pin=stage[1])
                    except StagedCopyChangedError as e:  # (changed while it was read)
                        self._drop_staged(v, e)
                        adapter = await self._fetched(v, stage)
                        assert adapter is not None
            await self._finish(v, adapter)
            v.adapter = adapter
        except Exception as e:
            self.emit(
                "adapter_load", **info, digest=v.digest, ok=False, error=repr(e),
                timings=dict(v.timings),
            )  # fmt: skip
            raise
        info["digest"] = v.digest
        self.emit(
            "adapter_load", **info, ok=True, timings=dict(v.timings),
            total_s=time.perf_counter() - t0, nbytes=v.adapter.nbytes,
        )  # fmt: skip

    async def _finish(self, v: AdapterVersion, adapter: LoRAAdapter) -> None:
        """What a staged image needs before it serves: DoRA's row scales (they need the base
        weights: here) and, under tensor parallelism, every rank's shard (off the step
        thread). An adapter with LoRA on the experts is refused on an engine without
        expert-capable slots (``max_expert_loras`` 0)."""
        v.experts = adapter_has_experts(adapter)
        if v.experts and self.config.max_expert_loras == 0 and self.model_config.moe:
            raise AdapterConfigError(
                f"adapter {v.name!r} has LoRA on the experts but the engine has no "
                "expert-capable slots (max_expert_loras is 0): serve it with "
                "max_expert_loras > 0",
                field="target_modules",
            )
        if not v.parts and adapter.config.use_dora:
            await asyncio.to_thread(self._dora, v, adapter)
        if self._prepare_shards is not None:
            await asyncio.to_thread(self._prepare_shards, adapter)

    def _dora(self, v: AdapterVersion, adapter: LoRAAdapter) -> None:
        """Worker thread: a DoRA adapter's row scales against this model (model/lora/dora.py),
        checked and folded into its B."""
        t0 = time.perf_counter()
        assert v.local_dir is not None  # (on failure the registry releases v's region)
        folder = v.local_dir
        mags = sealed_read(v.seal, folder, lambda: load_magnitudes(folder, self.model_config))
        fold_dora(adapter, row_scales(self.model, adapter.name, adapter.weights, mags))
        v.timings["dora"] = time.perf_counter() - t0

    async def _fetched(
        self, v: AdapterVersion, stage: tuple[Any, bool] | None = None
    ) -> LoRAAdapter | None:
        """Make sure ``v``'s files are in the staging dir (fetched again if they went);
        ``stage`` = (dtype, pin): a fetch also stages ``v`` in the same pass and returns it."""
        await self.copy_written(v)
        if v.local_dir is not None and not await asyncio.to_thread(v.local_dir.is_dir):
            log.warning("adapter_staging_lost", name=v.name, path=str(v.local_dir))
            v.local_dir = None  # fetched again below; the digest must not change
        if v.local_dir is not None and v.seal is not None:
            try:  # (the stage checks the open files again: this spares a stage that fails)
                await asyncio.to_thread(v.seal.check_folder, v.local_dir)
            except StagedCopyChangedError as e:
                self._drop_staged(v, e)
        if v.local_dir is None:
            adapter = await self.fetcher.fetch_verify(v, trusted=v.trusted, stage=stage)
            await self.fetcher.trim_staging(self.registry.versions, keep=v)
            return adapter
        return None

    async def copy_written(self, v: AdapterVersion) -> None:
        """Wait for the staging copy ``v``'s load wrote after its pass (onepass.py's
        defer_copy): sealed, ``v.seal`` is set; a failed write drops the copy (the next
        ``_fetched`` fetches and verifies the source again)."""
        copy = v.copy
        if copy is None:
            return
        try:
            seal = await asyncio.wrap_future(copy)
            if v.copy is copy:
                v.copy, v.seal = None, seal
        except Exception as e:
            if v.copy is copy:
                v.copy = None
                if v.local_dir is not None:
                    self._drop_staged(v, e)

    def _drop_staged(self, v: AdapterVersion, why: Exception) -> None:
        """``v``'s staged copy is not the one verified (seal.py): removed; the next
        ``_fetched`` fetches and verifies the source again against ``v.digest``."""
        log.warning("adapter_staging_changed", name=v.name, path=str(v.local_dir), error=str(why))
        self.fetcher.discard(v)
        v.local_dir, v.seal = None, None

    async def _stage_combination(self, v: AdapterVersion) -> LoRAAdapter:
        """A combination's components' files (held as users meanwhile, so that no staging
        trim removes them), combined and staged as one adapter."""
        for c, _ in v.parts:
            c.users += 1
        try:
            for c, _ in v.parts:
                await self._fetched(c)
            return await self.stager.stage_combination(
                v, self.model.dtype, pin=self.device.type == "cuda"
            )
        finally:
            for c, _ in v.parts:
                self.registry.drop_user(c)

    # -- slots and residency ----------------------------------------------------------------------

    def land(self) -> list[tuple[AdapterVersion, SlotWriteError]]:
        """Slot writes that landed since the last call: their versions' requests may run
        (``slot_write`` events). Returns the writes that failed: the caller fails the requests
        waiting on those versions (which gave their slot back)."""
        failed = []
        for w in self.slots.poll():
            v = w.version
            if w.error is not None:
                msg = f"the slot write of adapter {v.name!r} failed: {w.error}"
                failed.append((v, SlotWriteError(msg, field="model")))
                continue
            v.timings["h2d"] = w.h2d_s
            nbytes = v.adapter.nbytes if v.adapter is not None else 0
            self.emit(
                "slot_write", name=v.name, digest=v.digest, slot=w.slot, h2d_s=w.h2d_s,
                nbytes=nbytes, copy_bytes=w.copy_bytes, h2d_gpu_s=w.gpu_s, h2d_copy_s=w.copy_s,
            )  # fmt: skip
        return failed

    def pending_writes(self) -> bool:
        """A slot was handed out and its write has not landed (or not been issued) yet."""
        return self.slots.pending()

    def residency(self) -> list[dict[str, Any]]:
        """Every version in memory (a GPU slot or the CPU tier): name, digest, tier ("gpu":
        holds a GPU slot, and stays in the CPU tier; "cpu"), pinned, rank, nbytes (its LoRA
        tensors in host memory) and current (the current version of its name)."""
        registry = self.registry
        current = {id(registry.get(n)) for n in registry.names()}
        rows = []
        for v in registry.versions():
            gpu = self.slots.slot_of(v) is not None
            if not gpu and v.state is not AdapterState.CPU:
                continue
            rows.append(
                {
                    "name": v.name,
                    "digest": v.digest,
                    "tier": "gpu" if gpu else "cpu",
                    "pinned": bool(v.pinned),
                    "rank": int(v.lora_rank or v.rank),
                    "nbytes": int(getattr(v.adapter, "nbytes", 0) or v.nbytes),
                    "current": id(v) in current,
                }
            )
        return rows
