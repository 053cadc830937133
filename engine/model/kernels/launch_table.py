"""Kernel launch configurations keyed by device: tuned rows per GPU family, a generic fallback.

Each kernel that picks its launch (block sizes, warps, pipeline stages, split-K) from the
problem's shape does it through a ``LaunchTable``: one entry per device key holding that
device's rows, and a ``GENERIC`` entry for every device without one of its own (and for the CPU,
where Triton runs under ``TRITON_INTERPRET``). The key of a CUDA device is its compute
capability, ``"sm90"`` for 9.0 (H100, H200: the GPUs the tuned rows were measured on); adding a
GPU family's measured rows is adding its entry, nothing else changes.

An entry is an ordered tuple of ``Rule``s. A rule holds a config, or a function of the shape
that returns one or None (where a size follows the shape, e.g. a row chunk of the hidden size,
or where a tuned config does not fit the problem, e.g. a K tile its scale groups do not allow),
and inclusive bounds on named shape dimensions (``tokens``, ``slots``, ``rank``, ...; a single
int means equal, None an open end). A lookup returns the config of the first rule whose bounds
hold and that gives one. Every entry ends with a rule without bounds that always gives one.

Generic entries must be correct on every GPU the engine supports (compute capability 8.0+,
README.md): their tiles must fit the smallest shared memory among them, 99 KB a block (sm_86,
sm_89, sm_120), and Triton's limits on dot shapes. ``tests/model/test_launch_tables.py`` checks
every row of every table against its kernel's constraints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

import torch

__all__ = [
    "GENERIC",
    "GENERIC_SMEM_BYTES",
    "LaunchTable",
    "Rule",
    "device_key",
    "device_sms",
]

GENERIC = "generic"
# shared memory a generic config may take: under the 99 KB (101376 B) a block gets on sm_86 /
# sm_89 / sm_120, with room for a kernel's own scratch
GENERIC_SMEM_BYTES = 96 * 1024

C = TypeVar("C")
Bound = int | tuple[int | None, int | None]


def device_key(device: torch.device | str | None) -> str:
    """The table key of ``device``: ``"sm{major}{minor}"`` for a CUDA device (``"sm90"``: an
    H100 / H200), ``"cpu"`` for any other device, ``GENERIC`` for None."""
    if device is None:
        return GENERIC
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return _cuda_key(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_key(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 (an H100/H200) off CUDA."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


class Rule(Generic[C]):
    """A config (or ``config(shape)``, None where it declines) for the shapes within
    ``bounds``."""

    __slots__ = ("config", "bounds")

    def __init__(self, config: C | Callable[[Mapping[str, int]], C], **bounds: Bound) -> None:
        self.config = config
        self.bounds = {k: (b, b) if isinstance(b, int) else b for k, b in bounds.items()}

    def matches(self, shape: Mapping[str, int]) -> bool:
        for name, (lo, hi) in self.bounds.items():
            v = shape[name]
            if (lo is not None and v < lo) or (hi is not None and v > hi):
                return False
        return True

    def resolve(self, shape: Mapping[str, int]) -> C | None:
        if callable(self.config):
            return self.config(shape)
        return self.config

    def __repr__(self) -> str:
        return f"Rule({self.config!r}, {self.bounds})"


class LaunchTable(Generic[C]):
    """A kernel's rules per device key; ``pick`` memoises (key, shape) -> config, since the
    launchers call it on every eager launch."""

    def __init__(self, kernel: str, entries: Mapping[str, tuple[Rule[C], ...]]) -> None:
        if GENERIC not in entries:
            raise ValueError(f"{kernel}: a launch table needs a {GENERIC!r} entry")
        for key, rules in entries.items():
            if not rules or rules[-1].bounds:
                raise ValueError(f"{kernel}[{key}]: the last rule must hold for every shape")
        self.kernel = kernel
        self.entries = dict(entries)
        self._memo: dict[tuple, C] = {}

    def rules(self, key: str) -> tuple[Rule[C], ...]:
        """The rules a device of ``key`` uses: its own entry, else the generic one."""
        return self.entries.get(key, self.entries[GENERIC])

    def pick(self, device: torch.device | str | None, **shape: int) -> C:
        key = (device_key(device), *shape.items())
        cfg = self._memo.get(key)
        if cfg is None:
            cfg = self._first(key[0], shape)
            if len(self._memo) > 4096:  # shapes seen in one process are few; never unbounded
                self._memo.clear()
            self._memo[key] = cfg
        return cfg

    def _first(self, key: str, shape: Mapping[str, int]) -> C:
        for rule in self.rules(key):
            if rule.matches(shape) and (cfg := rule.resolve(shape)) is not None:
                return cfg
        raise LookupError(f"{self.kernel}[{key}]: no rule takes {dict(shape)}")
