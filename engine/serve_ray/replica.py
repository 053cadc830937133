"""One engine replica: an ``AsyncEngine`` inside a Ray Serve replica actor.

The ingress calls it through a deployment handle (``generate`` streams ``RequestOutput``s) and
the router reads ``record_routing_stats``, which Ray Serve polls on every replica: the engine's
exact residency (adapters in GPU slots, adapters in the CPU tier) and load (running + waiting).

Every ``generate`` stream starts with an ``Accepted`` item, yielded before the engine sees the
request's content: from then on the request may be what kills this process (a hostile grammar
crashing a native library), so the ingress never sends an acknowledged request to another
replica (``ClusterEngine.generate``).

Engine errors travel as ``WireError`` items of the stream, not as Ray task errors: the ingress
raises the same typed error (with its ``field``) that ``loraplex serve`` would have mapped.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import AdapterChoice
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.serve_ray.loopback import keep_replica_on_loopback

__all__ = ["Accepted", "ReplicaSpec", "EngineReplica", "WireError", "routing_stats"]

log = structlog.get_logger("loraplex.serve_ray")

# where a typed error may come from: the ingress rebuilds only these classes (never imports a
# module named by the wire)
_ERROR_MODULES = (
    "loraplex.engine.errors",
    "loraplex.engine.tokenizer",
)


@dataclass(frozen=True)
class WireError:
    """An engine error as it crosses from a replica to the ingress."""

    module: str
    name: str
    message: str
    field: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        kind = type(exc)
        return cls(kind.__module__, kind.__qualname__, str(exc), getattr(exc, "field", None))

    def exception(self) -> Exception:
        """The typed error again (a ``RuntimeError`` when its class is not an engine error)."""
        if self.module in _ERROR_MODULES:
            kind = getattr(importlib.import_module(self.module), self.name, None)
            if isinstance(kind, type) and issubclass(kind, Exception):
                try:
                    exc = kind(self.message)
                except TypeError:  # a constructor with other required arguments
                    exc = None
                if exc is not None:
                    if self.field is not None:
                        exc.field = self.field  # type: ignore[attr-defined]
                    return exc
        return RuntimeError(f"{self.name}: {self.message}")


@dataclass(frozen=True)
class Accepted:
    """The first item of every ``generate`` stream: this replica has the request and its engine
    is about to work on it. The ingress consumes it (its callers never see it)."""

    pid: int  # the replica's process (logged by the ingress if the replica dies)


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica starts with: the engine config and the static adapters
    (``(name, uri, sha256)``; the demo adapters come first when ``config.model`` is None)."""

    config: EngineConfig
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()


def routing_stats(engine: AsyncEngine) -> dict[str, Any]:
    """The residency and load the router reads (cheap: the engine's counters, no step)."""
    s = engine.stats()
    return {
        "gpu": list(s["gpu_resident"]),
        "cpu": list(s["cpu_resident"]),
        "load": int(s["running"]) + int(s["waiting"]),
        "adapters": [a["name"] for a in engine.list_adapters()],
        "pid": os.getpid(),
        # the engine's counters (the ingress's /metrics shows them summed over the replicas)
        "stats": {k: v for k, v in s.items() if k != "adapter_refs"},
    }


class MisroutedCallError(RuntimeError):
    """A call meant for one replica reached another (its target is gone)."""


def _check_target(replica: str | None) -> None:
    """A call meant for one replica must not run on another (a router bug otherwise)."""
    if replica is None:
        return
    from ray import serve

    me = serve.get_replica_context().replica_id.unique_id
    if replica != me:  # (the router sends a call for a replica it no longer has elsewhere)
        raise MisroutedCallError(f"a call for replica {replica} reached replica {me}")


class EngineReplica:
    """The deployment class (``cluster.py`` wraps it with ``serve.deployment``)."""

    async def __init__(self, spec: ReplicaSpec) -> None:
        keep_replica_on_loopback()  # before Ray Serve starts this replica's gRPC server
        self.engine = AsyncEngine(spec.config)
        await self.engine.start()
        try:
            if spec.config.model is None:  # the demo model comes with its demo adapters
                from loraplex.engine.demo import register_demo_adapters

                await register_demo_adapters(self.engine)
            for name, uri, sha256 in spec.lora_modules:
                await self.engine.add_adapter(name, uri, sha256)
        except BaseException:
            await self.engine.close()
            raise
        log.info("replica_started", pid=os.getpid(), adapters=len(self.engine.list_adapters()))

    async def info(self, *, replica: str | None = None) -> dict[str, Any]:
        """What the ingress serves from: names, limits, the tokenizer (pickled: the ingress
        needs no access to the model folder)."""
        _check_target(replica)
        e = self.engine
        return {
            "model_name": e.model_name,
            "model_root": e.model_root,
            "max_model_len": e.max_model_len,
            "capacity": e.capacity_report(),
            "tokenizer": e.tokenizer,
            "adapters": e.list_adapters(),
            "pid": os.getpid(),
        }

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        adapter: AdapterChoice,
        request_id: str,
        *,
        group: str | None = None,
        replica: str | None = None,
    ) -> AsyncIterator[Accepted | RequestOutput | WireError]:
        """Stream one engine request: ``Accepted`` first, before the engine touches the request
        (a request that crashes this process was acknowledged, so the ingress fails it instead
        of replaying it on another replica), then its outputs. Cancelling the call (client
        gone, ingress abort) ends the engine request: ``AsyncEngine.generate`` aborts it when
        its consumer stops. ``replica``: the call was sent to this replica on purpose (warm-ups,
        tests)."""
        _check_target(replica)  # (a misrouted call is refused unacknowledged: no engine work)
        yield Accepted(os.getpid())
        try:
            async for out in self.engine.generate(prompt, params, adapter, request_id, group=group):
                yield out
        except Exception as e:  # noqa: BLE001 - handed to the ingress as a typed error
            yield WireError.of(e)

    async def add_adapter(
        self, name: str, uri: str, sha256: str | None, trusted: bool, *, replica: str | None = None
    ) -> dict[str, Any] | WireError:
        """``replica``: the replica the router was asked to send this call to (checked)."""
        _check_target(replica)
        try:
            return await self.engine.add_adapter(name, uri, sha256, trusted=trusted)
        except Exception as e:  # noqa: BLE001
            return WireError.of(e)

    async def remove_adapter(self, name: str, *, replica: str | None = None) -> WireError | None:
        _check_target(replica)
        try:
            await self.engine.remove_adapter(name)
        except Exception as e:  # noqa: BLE001
            return WireError.of(e)
        return None

    async def stats(self, *, replica: str | None = None) -> dict[str, Any]:
        _check_target(replica)
        return self.engine.stats()

    async def record_routing_stats(self, *, replica: str | None = None) -> dict[str, Any]:
        """Polled by Ray Serve's controller and pushed to every router (the ingress).

        NOTE: async, so it runs on the engine's event loop (Ray runs plain methods in a
        thread, and the engine's state is read on its loop only)."""
        _check_target(replica)
        return routing_stats(self.engine)

    async def check_health(self) -> None:
        self.engine.stats()  # raises once the engine is closed: Ray replaces the replica

    async def __del__(self) -> None:
        await self.engine.close()
