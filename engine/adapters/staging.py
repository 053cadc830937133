"""The stage step of a cold load: an adapter version's fetched files (fetch.py) parsed into
one slot image (model/lora/slot_image.py) in host memory, the CPU-tier tensors the engine
copies into a GPU slot.

The image is written into a region of the engine's host pool (pinned, shared memory,
host_pool.py) when it has one, else into a fresh buffer. With loader processes
(``loader_procs.py``) a helper parses and packs straight into the region and this process
adopts it (``adopt_packed``); otherwise a thread of this process does (``stage_file``: each
module from the file into the image, the parser's checks, one pass per tensor), and a cancelled
stage stops that thread and waits for it before the region goes back to the pool
(thread_jobs.py). Combinations (combine.py) are always made here, from their components' files
(``stage_packed``: an adapter already in memory packed). Either way the adapter's weights
become views of its image, made on access.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from loraplex.engine.adapters.combine import combine_adapters
from loraplex.engine.adapters.host_pool import HostPool, Region
from loraplex.engine.adapters.loader_procs import LoaderProcesses
from loraplex.engine.adapters.onepass import PassResult, PassSource, read_pass
from loraplex.engine.adapters.parse import LoRAAdapter, load_adapter, load_full_tables
from loraplex.engine.adapters.region_wait import RegionWaiter
from loraplex.engine.adapters.seal import Seal, sealed_read
from loraplex.engine.adapters.thread_jobs import run_to_end
from loraplex.engine.adapters.version import AdapterVersion
from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import AdapterNotFoundError, StagedCopyChangedError
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.lora.slot_image import (
    PackedAdapter,
    PackedWeights,
    PackEntry,
    pack_adapter,
)

__all__ = ["AdapterStager", "stage_packed", "stage_file", "adopt_packed", "adapter_of"]


class AdapterStager:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, pool: HostPool | None
    ) -> None:
        self.config = config
        self.model_config = model_config  # the adapter checks' (fetch.py)
        self.pool = pool  # regions the stage step packs into (None: a fresh buffer per load)
        self.procs: LoaderProcesses | None = None  # set once the loader started its helpers
        self.regions = RegionWaiter(pool)  # loads waiting for host memory (region_wait.py)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def release(self, v: AdapterVersion) -> None:
        """``v``'s CPU-tier tensors are gone: its host-pool region is reused once no slot write
        out of it is queued or in flight (host_pool.py)."""
        if v.region is not None and self.pool is not None:
            self.pool.release(v.region)
        v.region = None

    async def _acquire(self, v: AdapterVersion) -> Region:
        """A host-pool region for ``v``'s load; the wait for one is its ``host_wait`` timing
        (with every region held by adapters whose requests are queued, loads wait here for
        slot turnover, not for the load path)."""
        t0 = time.perf_counter()
        region = await self.regions.acquire()
        v.timings["host_wait"] = time.perf_counter() - t0
        return region

    async def stage(self, v: AdapterVersion, dtype: torch.dtype, *, pin: bool) -> LoRAAdapter:
        """Parse the staged files into CPU tensors: into a host-pool region (pinned, shared)
        when the engine has a pool, else a fresh buffer (pinned if ``pin``). Sets
        ``v.region``."""
        if v.local_dir is None or not v.local_dir.exists():
            raise AdapterNotFoundError(f"adapter {v.name!r} has no staged files", field="model")
        if self.pool is None:
            return await asyncio.to_thread(self._stage_here, v, dtype, None, pin)
        region = await self._acquire(v)
        if self.procs is None:
            return await self._stage_into(v, dtype, region)
        ended: list[bool] = []  # [ok] once no helper writes into the region any more

        def end(ok: bool) -> None:
            ended.append(ok)
            if not ok:
                self.pool.release(region)  # type: ignore[union-attr]

        try:
            r = await self.procs.call(
                "stage",
                {
                    "local_dir": str(v.local_dir),
                    "name": v.name,
                    "dtype": str(dtype).removeprefix("torch."),
                    "max_lora_rank": self.config.max_lora_rank,
                    "full_modules": self.config.max_full_module_loras > 0,
                    "region": (region.offset, region.nbytes),
                    "seal": v.seal,
                    "expect_digest": v.digest,
                },
                on_end=end,
            )
            adapter = await asyncio.to_thread(self._adopt, v, r, region, dtype)
            if adapter.config.modules_to_save:  # not in the region: read here (model/lora/full.py)
                adapter.full = await asyncio.to_thread(
                    self._full_tables, v.seal, Path(r["path"]), dtype
                )
        except BaseException:
            if ended == [True]:  # the helper finished; the failure is ours
                self.pool.release(region)
            raise
        v.timings["stage"] = r["stage_s"]
        v.region = region
        return adapter

    async def in_thread(
        self,
        v: AdapterVersion,
        run: Callable[[torch.Tensor | None, torch.dtype | None], Awaitable[Any]],
        stage: tuple[torch.dtype, bool] | None,
        *,
        wait: bool = True,
    ) -> tuple[Any, LoRAAdapter | None]:
        """A fetch whose pass also stages (``stage`` = (dtype, pin); fetch_pass.py) in this
        process: ``run(out, dtype)`` packs into a host-pool region (or a new buffer without a
        pool; ``dtype`` None: no image); on any failure the region goes back to the pool (the
        pass's thread has stopped by then: ``run_to_end``). Sets ``v.region``; returns run's
        result and the staged adapter. ``wait=False`` (add_adapter's pass): when no region is
        free now the pass does not pack (the adapter returned is None)."""
        region = None
        if stage is not None and self.pool is not None:
            region = await self._acquire(v) if wait else self.regions.now()
            if region is None:
                stage = None
        if stage is None:
            return await run(None, None), None
        try:
            out = self.pool.view(region, stage[0]) if region is not None else None  # type: ignore[union-attr]
            got = await run(out, stage[0])
            t0 = time.perf_counter()
            adapter = await asyncio.to_thread(
                adapter_of, got.checked, v.name, str(got.result.local_dir), self.model_config,
                stage[0], True, got.checked.seal,
            )  # fmt: skip
        except BaseException:
            if region is not None:
                self.pool.release(region)  # type: ignore[union-attr]
            raise
        v.timings["stage"] = time.perf_counter() - t0
        v.region = region
        return got, adapter

    async def in_helper(
        self,
        v: AdapterVersion,
        call: Callable[[tuple[int, int] | None, Any], Awaitable[dict]],
        stage: tuple[torch.dtype, bool] | None,
        *,
        wait: bool = True,
    ) -> tuple[dict, LoRAAdapter | None]:
        """The same in a loader process: ``call(region, on_end)`` runs the helper's job, which
        packs into the region (offset, bytes); the region goes back to the pool on failure,
        once no helper writes into it any more. ``wait``: as ``in_thread``'s."""
        region = None
        if stage is not None and self.pool is not None:
            region = await self._acquire(v) if wait else self.regions.now()
        if region is None:
            return await call(None, None), None
        ended: list[bool] = []

        def end(ok: bool) -> None:
            ended.append(ok)
            if not ok:
                self.pool.release(region)  # type: ignore[union-attr]

        try:
            r = await call((region.offset, region.nbytes), end)
            t0 = time.perf_counter()
            adapter = await asyncio.to_thread(self._adopt, v, r, region, stage[0])
            if adapter.config.modules_to_save:  # not in the region: read here (model/lora/full.py)
                adapter.full = await asyncio.to_thread(
                    self._full_tables, r["seal"], Path(r["local_dir"]), stage[0]
                )
        except BaseException:
            if ended == [True]:  # the helper finished; the failure is ours
                self.pool.release(region)
            raise
        v.timings["stage"] = time.perf_counter() - t0
        v.region = region
        return r, adapter

    async def stage_combination(
        self, v: AdapterVersion, dtype: torch.dtype, *, pin: bool
    ) -> LoRAAdapter:
        """Stage a combination (``v.parts``, whose files are staged): its components are
        parsed in float32, combined (combine.py) and packed like one adapter, in a thread of
        this process. Sets ``v.region``."""
        for c, _ in v.parts:
            if c.local_dir is None or not c.local_dir.exists():
                raise AdapterNotFoundError(
                    f"adapter {c.name!r} has no staged files", field="adapters"
                )
        if self.pool is None:
            return await asyncio.to_thread(self._stage_here, v, dtype, None, pin)
        return await self._stage_into(v, dtype, await self._acquire(v))

    async def _stage_into(
        self, v: AdapterVersion, dtype: torch.dtype, region: Region
    ) -> LoRAAdapter:
        """Stage ``v`` into ``region`` in a thread of this process. Cancelled, the thread is
        stopped and waited for before the region goes back to the pool (it writes into it)."""
        assert self.pool is not None
        try:
            adapter = await run_to_end(lambda stop: self._stage_here(v, dtype, region, False, stop))
        except BaseException:
            self.pool.release(region)
            raise
        v.region = region
        return adapter

    def _combine(self, v: AdapterVersion, dtype: torch.dtype) -> LoRAAdapter:
        """A combination (``v.parts``) from its components' staged files."""
        R = self.config.max_lora_rank
        parts = [
            (
                sealed_read(c.seal, c.local_dir, lambda c=c: load_adapter(  # type: ignore[arg-type,misc]
                    c.local_dir, self.model_config, max_lora_rank=R, name=c.name
                )),
                w,
            )
            for c, w in v.parts
        ]  # fmt: skip
        return combine_adapters(parts, name=v.name, max_lora_rank=R, dtype=dtype)

    def _stage_here(
        self,
        v: AdapterVersion,
        dtype: torch.dtype,
        region: Region | None,
        pin: bool,
        stop: threading.Event | None = None,
    ) -> LoRAAdapter:
        t0 = time.perf_counter()
        out = self.pool.view(region, dtype) if region is not None and self.pool else None
        # one contiguous (pinned) slot image; write_slot copies it in one H2D transfer
        if v.parts:  # a combination: made from its components' tensors, then packed
            adapter = self._combine(v, dtype)
            stage_packed(adapter, self.config.max_lora_rank, pin=pin, out=out)
        else:  # straight from the file into the image
            assert v.local_dir is not None
            adapter = stage_file(
                v.local_dir, self.model_config, self.config.max_lora_rank, dtype=dtype,
                name=v.name, full_modules=self.config.max_full_module_loras > 0, pin=pin, out=out,
                stop=stop, seal=v.seal, expect_digest=v.digest,
            )  # fmt: skip
        v.timings["stage"] = time.perf_counter() - t0
        return adapter

    def _full_tables(self, seal: Seal | None, folder: Path, dtype: torch.dtype) -> Any:
        """An adapter's modules_to_save tables, read from its sealed staging copy."""
        return sealed_read(seal, folder, lambda: load_full_tables(folder, self.model_config, dtype))

    def _adopt(self, v: AdapterVersion, r: dict, region: Region, dtype: torch.dtype) -> LoRAAdapter:
        """The adapter a helper packed into ``region``: tensors are views of the region."""
        assert self.pool is not None
        entries = {(e[0], e[1]): PackEntry(*e) for e in r["entries"]}
        packed = PackedAdapter(
            self.pool.view(region, dtype, r["numel"]), entries, self.config.max_lora_rank
        )
        path = r.get("path") or r["local_dir"]
        adapter = LoRAAdapter(name=v.name, path=path, config=r["config"], weights={})
        adopt_packed(adapter, packed)
        return adapter


def stage_packed(
    adapter: LoRAAdapter, max_rank: int, *, pin: bool, out: torch.Tensor | None = None
) -> PackedAdapter:
    """Pack (pinned if ``pin``), point ``adapter.weights`` at views of the packed buffer (one
    copy of the data in host memory: the tensors' values are unchanged, B becomes the (out, r)
    transposed view of its (r, out) block) and attach the packed form to the adapter."""
    packed = pack_adapter(adapter, max_rank, pin=pin, out=out)
    adopt_packed(adapter, packed)
    return packed


def stage_file(
    path: str | Path,
    model_config: ModelConfig,
    max_rank: int,
    *,
    dtype: torch.dtype,
    name: str | None = None,
    full_modules: bool = False,
    read_full: bool = True,
    pin: bool = False,
    out: torch.Tensor | None = None,
    stop: threading.Event | None = None,
    seal: Seal | None = None,
    expect_digest: str | None = None,
) -> LoRAAdapter:
    """An adapter folder (the engine's verified staging copy) packed into its slot image in
    one pass (onepass.py: every header and value check again), the same values bit for bit as
    ``stage_packed(load_adapter(...))``. ``seal``: the copy's seal (seal.py), checked on the
    open files before and after the pass, which hashes nothing; without one, an
    ``expect_digest`` makes the pass hash and compare (the second trust decision a seal
    spares); a mismatch either way is a StagedCopyChangedError. ``read_full``: also read
    modules_to_save tables into ``adapter.full``; ``stop``: checked before each chunk; set,
    the stage raises StageStopped."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterNotFoundError(f"adapter folder {str(path)!r} does not exist")
    try:
        src = PassSource.open_dir(folder)
    except FileNotFoundError:
        load_adapter(folder, model_config, max_lora_rank=max_rank, keep=False)  # its typed error
        raise
    hash_bytes = seal is None and bool(expect_digest)

    def expect(digest: str) -> None:
        if digest != expect_digest:
            raise StagedCopyChangedError(
                f"the staged copy at {str(folder)!r} has digest {digest[:12]}..., its version "
                f"{str(expect_digest)[:12]}...",
                field="sha256",
            )

    try:
        got = read_pass(
            src, model_config, max_lora_rank=max_rank, max_bytes=None,
            full_modules=full_modules, dtype=dtype, pin=pin, out=out, hash_bytes=hash_bytes,
            expect=expect if hash_bytes else None, stop=stop, sealed=seal,
        )  # fmt: skip
    finally:
        src.close()
    name = name or folder.name
    return adapter_of(got, name, str(folder), model_config, dtype, read_full, seal)


def adapter_of(
    got: PassResult,
    name: str,
    path: str,
    model_config: ModelConfig,
    dtype: torch.dtype,
    read_full: bool,
    seal: Seal | None = None,
) -> LoRAAdapter:
    """The adapter a pass packed: its weights are views of the slot image; ``read_full``: its
    modules_to_save tables read from ``path`` (not in the image; checked against ``seal``)."""
    assert got.packed is not None
    adapter = LoRAAdapter(name=name, path=path, config=got.config, weights={})
    adopt_packed(adapter, got.packed)
    if read_full and got.config.modules_to_save:
        folder = Path(path)
        adapter.full = sealed_read(
            seal, folder, lambda: load_full_tables(folder, model_config, dtype)
        )
    return adapter


def adopt_packed(adapter: LoRAAdapter, packed: PackedAdapter) -> None:
    """Point ``adapter.weights`` at views of ``packed`` (made on access) and attach it (see
    ``stage_packed``)."""
    adapter.weights = PackedWeights(packed)
    adapter.image = packed
