"""Helpers of the adapter-lifecycle tests (test_lifecycle_*, test_loader_*).

- ``config``, ``collect``, ``assert_idle``, ``evict_cpu``: tests/helpers/engine.py's,
  re-exported.
- ``proc_config``, ``pool_idle``, ``PROMPT``, ``GREEDY``: engines with loader processes.
- ``HeldPlugin``: an in-process resolver plugin for ``held://lib/<name>`` URIs, backed by local
  folders, whose downloads wait on a test-controlled ``asyncio.Event`` (``gate``).
- ``NamePlugin``: maps chosen adapter names to URIs (``loraplex_resolve_adapter_name``).
- ``StepGate``: parks the engine's step thread at a chosen step so a test can act in between.
- broken adapters, each built by editing a copy of a good one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.adapters.registry import AdapterState
from loraplex.plugins import hookimpl
from loraplex.resolvers import AdapterSource, Report, Resolver, ResolverSettings, copy_file
from tests.helpers.engine import assert_idle, collect, config, evict_cpu
from tests.helpers.models import copy_adapter

__all__ = [
    "GREEDY",
    "PROMPT",
    "HeldPlugin",
    "NamePlugin",
    "StepGate",
    "assert_idle",
    "collect",
    "evict_cpu",
    "config",
    "derived_adapter",
    "BROKEN",
    "pool_idle",
    "proc_config",
    "staged_leftovers",
    "wait_until",
]

W = "adapter_model.safetensors"
C = "adapter_config.json"


async def wait_until(cond: Callable[[], bool], what: str, tries: int = 2000) -> None:
    """Poll ``cond`` on the event loop (bounded; a hang fails instead of blocking the suite)."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


# -- plugins ------------------------------------------------------------------------------------


class _HeldSource(AdapterSource):
    def __init__(self, plugin: HeldPlugin, name: str, folder: Path) -> None:
        self.plugin, self.name, self.folder = plugin, name, folder
        self.pinned_uri = f"held://lib/{name}"
        self.files = {p.name: p.stat().st_size for p in folder.iterdir()}

    async def download(self, name: str, target: Path, report: Report) -> None:
        if name == W:
            self.plugin.waiting += 1
            self.plugin.started.set()
            try:
                await self.plugin.gate.wait()
            except asyncio.CancelledError:
                self.plugin.cancelled += 1
                raise
            finally:
                self.plugin.waiting -= 1
        await copy_file(self.folder / name, target, report)


class HeldResolver(Resolver):
    schemes = ("held",)

    def __init__(self, settings: ResolverSettings, plugin: HeldPlugin) -> None:
        super().__init__(settings)
        self.plugin = plugin

    async def open(self, uri: str) -> AdapterSource:
        name = uri.removeprefix("held://lib/")
        self.plugin.opens.append(name)
        return _HeldSource(self.plugin, name, self.plugin.sources[name])


class HeldPlugin:
    """``held://lib/<name>`` from ``sources[name]``; the weights download awaits ``gate``."""

    def __init__(self, sources: dict[str, Path], *, open_gate: bool = False) -> None:
        self.sources = dict(sources)
        self.gate = asyncio.Event()
        if open_gate:
            self.gate.set()
        self.started = asyncio.Event()  # some download reached the gate
        self.opens: list[str] = []  # one entry per fetch (resolver open)
        self.waiting = 0  # downloads parked at the gate now
        self.cancelled = 0  # downloads cancelled at the gate

    @hookimpl
    def loraplex_resolvers(self, settings: ResolverSettings) -> list[Resolver]:
        return [HeldResolver(settings, self)]


class NamePlugin:
    """Resolves chosen adapter names to URIs; other names fall through (to the template)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    @hookimpl
    def loraplex_resolve_adapter_name(self, name: str, settings: ResolverSettings) -> str | None:
        return self.names.get(name)


# -- the step thread ----------------------------------------------------------------------------


class StepGate:
    """Parks the step executor's ``launch`` (the step thread) at the first step for which
    ``when(plan)`` holds, until ``release()``; ``reached`` is set (on the loop) when it parks."""

    def __init__(self, engine: Any, when: Callable[[Any], bool]) -> None:
        executor = engine.testing.executor
        self.when = when
        self.loop = asyncio.get_running_loop()
        self.reached = asyncio.Event()
        self.plan: Any = None
        self._go = threading.Event()
        self._launch = executor.launch
        executor.launch = self._gated

    def _gated(self, plan: Any, items: Any, prev: Any = None) -> Any:
        if self.when is not None and self.when(plan):
            self.when, self.plan = None, plan
            self.loop.call_soon_threadsafe(self.reached.set)
            self._go.wait(timeout=30)  # a failing test must not hang the suite
        return self._launch(plan, items, prev)

    def release(self) -> None:
        self._go.set()


# -- adapters -----------------------------------------------------------------------------------


def derived_adapter(src: Path, dst: Path, seed: int) -> Path:
    """A different adapter of the same shapes: ``src``'s tensors shuffled and sign-flipped."""
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(src / W)
    out = {}
    for k, t in sorted(tensors.items()):
        perm = torch.randperm(t.shape[1], generator=g) if ".lora_B." in k else None
        t = t[:, perm] if perm is not None else t
        out[k] = -t if ".lora_B." in k else t
    return copy_adapter(src, dst, tensors=out)


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    h = json.dumps(header).encode()
    n = len(h) if header_len is None else header_len
    path.write_bytes(n.to_bytes(8, "little") + h + data)


def truncated(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst)
    os.truncate(dst / W, (dst / W).stat().st_size - 10)
    return dst


def overlapping(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst)
    header, data = _header(dst / W)
    keys = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
    )
    begin, end = header[keys[1]]["data_offsets"]
    header[keys[1]]["data_offsets"] = [begin - 4, end - 4]  # overlaps the tensor before it
    _write_header(dst / W, header, data)
    return dst


def oversized_header(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst)
    header, data = _header(dst / W)
    _write_header(dst / W, header, data, header_len=1 << 40)
    return dst


def bin_only(good: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    shutil.copy(good / C, dst / C)
    (dst / "adapter_model.bin").write_bytes(b"\x80\x04\x95pickle, never opened")
    return dst


def rank_too_big(good: Path, dst: Path, rank: int = 32) -> Path:
    """Real rank-``rank`` tensors (``good``'s tiled) and a config that says so."""
    tensors = load_file(good / W)
    r = next(t.shape[0] for k, t in tensors.items() if ".lora_A." in k)
    rep = rank // r
    out = {
        k: (t.repeat(rep, 1) if ".lora_A." in k else t.repeat(1, rep) / rep)
        for k, t in tensors.items()
    }
    return copy_adapter(good, dst, tensors=out, r=rank, lora_alpha=2 * rank)


def wrong_shapes(good: Path, dst: Path) -> Path:
    """One A matrix has 8 more input features than the base projection."""
    tensors = load_file(good / W)
    key = sorted(k for k in tensors if ".lora_A." in k)[0]
    a = tensors[key]
    tensors[key] = torch.cat([a, torch.zeros(a.shape[0], 8)], dim=1)
    return copy_adapter(good, dst, tensors=tensors)


# name -> (builder, expected error class name); each builder edits a copy of a good adapter
BROKEN: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "truncated": (truncated, "AdapterFormatError"),
    "overlapping": (overlapping, "AdapterFormatError"),
    "oversized-header": (oversized_header, "AdapterFormatError"),
    "bin-only": (bin_only, "AdapterFormatError"),
    "rank-too-big": (rank_too_big, "AdapterRankError"),
    "wrong-shapes": (wrong_shapes, "AdapterShapeError"),
}


def staged_leftovers(engine: Any) -> list[Path]:
    """Paths under the engine's adapter cache dir that belong to no live, fetched version
    (partial downloads, staging dirs of cancelled or failed loads, dropped versions)."""
    internals = engine.testing
    live = {v.local_dir for v in internals.adapters.registry.versions() if v.local_dir is not None}
    cache = internals.adapters.fetcher.cache_dir
    out = []
    for p in sorted(cache.rglob("*")):
        if any(p == d or d in p.parents for d in live):
            continue
        out.append(p)
    return out


PROMPT = [12, 7, 200, 45, 3, 88, 19, 5]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def proc_config(model_dir: Path, tmp_path: Path, **kw):
    base = dict(
        loader_processes=1,
        local_roots=(str(tmp_path),),
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    base.update(kw)
    return config(model_dir, **base)


def pool_idle(engine: AsyncEngine) -> None:
    """Every host-pool region in use belongs to a CPU-tier version."""
    internals = engine.testing
    held = [v for v in internals.adapters.registry.versions() if v.region is not None]
    assert all(v.state is AdapterState.CPU for v in held), held
    assert internals.adapters.pool.in_use() == len(held)
