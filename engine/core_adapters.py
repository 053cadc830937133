"""The adapters part of ``EngineCore`` (core.py): registration, names and compositions, cold
loads through the loader, and slot writes landing. A mixin: the state it works on (the adapter
manager, the loader, the executor, ...) is the core's, built in ``EngineCore.__init__``."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from loraplex.engine.adapters.checks import fold_dora
from loraplex.engine.adapters.fetch import AdapterFetcher
from loraplex.engine.adapters.parse import LoRAAdapter, load_magnitudes
from loraplex.engine.adapters.registry import AdapterRegistry, AdapterState, AdapterVersion
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import (
    AdapterCompositionError,
    AdapterNotFoundError,
    InvalidRequestError,
    SlotWriteError,
)
from loraplex.engine.executor import StepExecutor
from loraplex.engine.model.lora.dora import row_scales
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.request import Request
from loraplex.engine.scheduler import Scheduler

__all__ = ["AdapterOps", "MAX_COMPOSITION"]

MAX_COMPOSITION = 16  # adapters in one composition

log = structlog.get_logger("loraplex.engine")


class AdapterOps:
    """``EngineCore``'s adapter methods (see the module docstring)."""

    config: EngineConfig
    adapters: AdapterRegistry
    slots: SlotStore
    loader: AdapterFetcher
    executor: StepExecutor
    scheduler: Scheduler
    model: CausalLM
    model_config: Any
    device: Any
    _load_gate: asyncio.Semaphore | None
    emit: Callable[..., None]  # EngineCore.emit
    fail: Callable[[Request, BaseException], None]  # EngineCore.fail

    async def add_adapter(
        self, name: str, uri: str, sha256: str | None, *, trusted: bool = True
    ) -> AdapterVersion:
        """Add an adapter now (fetched, verified and preflighted before it is registered).

        ``trusted``: operator configuration (``--lora-modules``), allowed verbatim; otherwise
        (runtime admin loads) the source must pass the allowlist policy.
        """
        if self.config.max_loras == 0:
            raise InvalidRequestError("this engine runs with max_loras=0: adapters are disabled")
        if trusted:
            await self.loader.allow_static(uri)
        v = self.adapters.new_version(name, uri)
        v.trusted = trusted
        await self.loader.fetch_verify(v, sha256, trusted=trusted)
        v = self.adapters.register(v)
        await self.loader.trim_staging(self.adapters.versions(), keep=v)
        return v

    def remove_adapter(self, name: str) -> None:
        self.adapters.unregister(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        self.adapters.pin(name, pinned)

    def list_adapters(self) -> list[dict[str, Any]]:
        out = []
        for name in self.adapters.names():
            v = self.adapters.get(name)
            out.append({"name": name, "uri": v.uri, "digest": v.digest, "state": v.state.value})
        return out

    def _resolve_adapter(self, name: str) -> AdapterVersion:
        """The current version of ``name``; unknown names go through dynamic resolution."""
        try:
            return self.adapters.get(name)
        except AdapterNotFoundError:
            uri = self.loader.dynamic_uri(name) if self.config.max_loras else None
            if uri is None:
                raise
        v = self.adapters.new_version(name, uri, dynamic=True)
        return self.adapters.register(v)

    async def load_before_tokenizing(self, adapter: Any) -> None:
        """Where adapters may add tokens (``lora_extra_vocab_size`` > 0), a name resolved at
        request time is loaded before its request is tokenized, so that the request is
        tokenized with the adapter's own tokenizer if it has one (the request would wait for
        this load anyway). A no-op for the base, compositions, names loaded ahead and names
        fetched before (their tokenizer is known). The load's typed error is raised here and
        the name is forgotten, as when a request's load fails; the load counts as the miss of
        the request that uses it next."""
        if not self.config.lora_extra_vocab_size or not isinstance(adapter, str):
            return
        v = self._resolve_adapter(adapter)  # typed error when nothing resolves the name
        if not v.dynamic or v.digest:
            return
        v.tokenize_after_load = True
        self.adapters.hold(v)
        try:
            if v.load_task is not None:
                await asyncio.wait({v.load_task})
        finally:
            self.adapters.drop_user(v)
        if v.state is AdapterState.FAILED:
            error = v.error or RuntimeError(f"adapter {v.name!r} failed to load")
            if v.users == 0:
                self.adapters.reset_failed(v)  # forgotten: the next request resolves it again
            raise error
        if v.state is AdapterState.CPU:
            v.cold_pending = True

    def _resolve_composition(self, parts: Sequence[tuple[str, float]]) -> AdapterVersion:
        """The combination version of ``parts`` (made and cached by the manager); every
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
                v = self.adapters.get(name)
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
        return self.adapters.combination(versions)

    def _drop_unused_adapter(self, v: AdapterVersion) -> None:
        """Forget a dynamic version resolved for a request that was then rejected, unless some
        other request uses it (else made-up names would pile up in the registry)."""
        if v.dynamic and v.users == 0 and v.state is AdapterState.REGISTERED:
            self.adapters.forget(v)

    async def _load_adapter(self, v: AdapterVersion) -> None:
        # NOTE: loads beyond max_concurrent_loads queue here (in loader processes their CPU
        # work is off this process's GIL; in threads it competes with the step thread)
        if self._load_gate is None:
            self._load_gate = asyncio.Semaphore(max(1, self.config.max_concurrent_loads))
        async with self._load_gate:
            await self._load_adapter_now(v)

    async def _load_adapter_now(self, v: AdapterVersion) -> None:
        t0 = time.perf_counter()
        if "stage" in v.timings:
            v.timings.clear()  # a re-stage must not report an earlier load's stages
        info = {"name": v.name, "uri": v.uri}
        try:
            if v.parts:
                adapter = await self._stage_combination(v)
            else:
                await self._fetched(v)
                adapter = await self.loader.stager.stage(
                    v, self.model.dtype, pin=self.device.type == "cuda"
                )
                if adapter.config.use_dora:  # the row scales need the base weights: here
                    await asyncio.to_thread(self._compute_dora, v, adapter)
            if self.executor.runner.tp_size > 1:  # every rank's shard, cut off the step thread
                await asyncio.to_thread(self.executor.runner.prepare_adapter, adapter)
            v.adapter = adapter
        except Exception as e:
            self.emit(
                "adapter_load",
                **info,
                digest=v.digest,
                ok=False,
                error=repr(e),
                timings=dict(v.timings),
            )
            raise
        info["digest"] = v.digest
        total = time.perf_counter() - t0
        self.emit(
            "adapter_load",
            **info,
            ok=True,
            timings=dict(v.timings),
            total_s=total,
            nbytes=v.adapter.nbytes,
        )

    def _compute_dora(self, v: AdapterVersion, adapter: LoRAAdapter) -> None:
        """Worker thread: a DoRA adapter's row scales against this model (model/lora/dora.py)."""
        t0 = time.perf_counter()
        assert v.local_dir is not None  # (on failure the manager releases v's region)
        mags = load_magnitudes(v.local_dir, self.model_config)
        fold_dora(adapter, row_scales(self.model, adapter.name, adapter.weights, mags))
        v.timings["dora"] = time.perf_counter() - t0

    async def _fetched(self, v: AdapterVersion) -> None:
        """Make sure ``v``'s files are in the staging dir (fetched again if they went)."""
        if v.local_dir is not None and not await asyncio.to_thread(v.local_dir.is_dir):
            log.warning("adapter_staging_lost", name=v.name, path=str(v.local_dir))
            v.local_dir = None  # fetched again below; the digest must not change
        if v.local_dir is None:
            await self.loader.fetch_verify(v, trusted=v.trusted)
            await self.loader.trim_staging(self.adapters.versions(), keep=v)

    async def _stage_combination(self, v: AdapterVersion):
        """A combination's components' files (held as users meanwhile, so that no staging
        trim removes them), combined and staged as one adapter."""
        for c, _ in v.parts:
            c.users += 1
        try:
            for c, _ in v.parts:
                await self._fetched(c)
            return await self.loader.stager.stage_combination(
                v, self.model.dtype, pin=self.device.type == "cuda"
            )
        finally:
            for c, _ in v.parts:
                self.adapters.drop_user(c)

    def _drain_failed_adapters(self) -> list[tuple[Request, BaseException]]:
        failed = [
            r
            for r in self.scheduler.waiting
            if r.adapter and r.adapter.state is AdapterState.FAILED
        ]
        out = [(r, r.adapter.error or RuntimeError("adapter load failed")) for r in failed]
        for r in failed:
            self.scheduler.waiting.remove(r)
        for v in {id(r.adapter): r.adapter for r in failed}.values():
            self.adapters.reset_failed(v)
        return out

    def _poll_slot_events(self) -> None:
        """Slot writes that landed: their versions' requests may run (``slot_write`` events);
        a write that failed fails the requests waiting on its adapter."""
        for w in self.slots.poll():
            v = w.version
            if w.error is not None:
                error = SlotWriteError(
                    f"the slot write of adapter {v.name!r} failed: {w.error}", field="model"
                )
                for req in [r for r in self.scheduler.waiting if r.adapter is v]:
                    self.fail(req, error)
                continue
            v.timings["h2d"] = w.h2d_s
            nbytes = v.adapter.nbytes if v.adapter is not None else 0
            self.emit(
                "slot_write", name=v.name, digest=v.digest, slot=w.slot, h2d_s=w.h2d_s,
                nbytes=nbytes, copy_bytes=w.copy_bytes, h2d_gpu_s=w.gpu_s, h2d_copy_s=w.copy_s,
            )  # fmt: skip

    def pending_slot_writes(self) -> bool:
        """A slot was handed out and its write has not landed (or not been issued) yet."""
        return self.slots.pending()
