"""The registry's alive adapter versions and indices over them, so that no path a load, a
request or a step takes scans every version (thousands may be registered).

``alive``: every version the registry still tracks, by identity, in the order it learnt them;
``stale``: those of them that are not the current version of their name (superseded,
unregistered, forgotten) and combinations: the only ones the registry's collection may drop;
``cpu``: those in the CPU tier; ``num_loading``: how many have a load in flight (the step
thread reads it, an int read is atomic). Every state change of an alive version goes through
``set_state`` (registry.py).
"""

from __future__ import annotations

from loraplex.engine.adapters.version import AdapterState, AdapterVersion

__all__ = ["VersionIndex"]


class VersionIndex:
    def __init__(self) -> None:
        self.alive: dict[int, AdapterVersion] = {}
        self.stale: dict[int, AdapterVersion] = {}
        self.cpu: dict[int, AdapterVersion] = {}
        self.num_loading = 0

    def __contains__(self, v: AdapterVersion) -> bool:
        return id(v) in self.alive

    def add(self, v: AdapterVersion, *, stale: bool = False) -> None:
        """``v`` joins the alive versions, in whatever state it is."""
        self.alive[id(v)] = v
        if stale:
            self.stale[id(v)] = v
        if v.state is AdapterState.LOADING:
            self.num_loading += 1
        elif v.state is AdapterState.CPU:
            self.cpu[id(v)] = v

    def remove(self, v: AdapterVersion) -> None:
        if self.alive.pop(id(v), None) is None:
            return
        self.stale.pop(id(v), None)
        self.cpu.pop(id(v), None)
        if v.state is AdapterState.LOADING:
            self.num_loading -= 1

    def mark_stale(self, v: AdapterVersion) -> None:
        """``v`` is no longer the current version of its name (if it is alive)."""
        if id(v) in self.alive:
            self.stale[id(v)] = v

    def set_state(self, v: AdapterVersion, state: AdapterState) -> None:
        """``v.state = state``, the indices kept (a version not alive has none to keep)."""
        alive = id(v) in self.alive
        if alive and v.state is AdapterState.LOADING:
            self.num_loading -= 1
        v.state = state
        if not alive:
            return
        if state is AdapterState.LOADING:
            self.num_loading += 1
        if state is AdapterState.CPU:
            self.cpu[id(v)] = v
        else:
            self.cpu.pop(id(v), None)
