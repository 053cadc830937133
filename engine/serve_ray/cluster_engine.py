"""``ClusterEngine``: the engine the ingress's server code talks to, backed by the replicas.

It has the surface of ``AsyncEngine`` that ``loraplex.engine.server`` uses (generate, abort,
adapters, names, limits, tokenizer, stats, subscribe), so ``create_app(ClusterEngine(...))``
serves the very routes, wire shapes, errors and streams of ``loraplex serve``. Each
``generate`` is one streaming call through the deployment handle; the ``ResidencyRouter``
picks the replica.

A request is sent to another replica only while no replica has acknowledged it: a replica's
stream starts with ``Accepted`` before its engine looks at the request, so a replica that dies
before that never had it (stale routing: it was already gone), and one that dies after it may
have been killed by the request itself (a grammar that crashes a native library). Replaying
such a request would take every replica down in turn: it fails with ``ReplicaFailedError``.

Runtime adapters (the admin routes) go to every live replica; a replica that Ray starts later
(a replacement) is given them by a reconcile task that compares each replica's adapter list in
its routing stats with the ingress's registry.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import structlog
from ray.exceptions import RayError, TaskCancelledError

from loraplex.engine.adapters.lifecycle import AdapterChoice
from loraplex.engine.errors import AdapterNotFoundError, EngineClosedError
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.serve_ray.board import Board
from loraplex.engine.serve_ray.replica import Accepted, MisroutedCallError, WireError
from loraplex.engine.serve_ray.routing import residency_key

__all__ = ["ClusterEngine", "ReplicaFailedError"]

log = structlog.get_logger("loraplex.serve_ray")

_RECONCILE_S = 1.0
_CALL_TIMEOUT_S = 120.0
_LIVENESS_POLL_S = 0.25  # how often a per-replica call checks that its replica is still there
_RETRIES = 2  # a request whose replica fails before acknowledging it is sent again
_RETRY_PAUSE_S = 0.5  # a per-replica call (adapter load, stats) that takes longer failed


class ReplicaFailedError(EngineClosedError):
    """The replica serving the request died or became unreachable (HTTP 503)."""


def _merge_stats(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Engine-shaped stats of the whole cluster: counts summed, adapter lists joined."""
    out: dict[str, Any] = {}
    for r in reports:
        for key, value in (r.get("stats") or {}).items():
            if isinstance(value, bool):
                out[key] = out.get(key, False) or value
            elif isinstance(value, (int, float)):
                out[key] = out.get(key, 0) + value
            elif isinstance(value, list):
                out[key] = sorted(set(out.get(key, [])) | set(value))
            elif isinstance(value, dict):
                merged = out.setdefault(key, {})
                for k, v in value.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        merged[k] = merged.get(k, 0) + v
    return out


class ClusterEngine:
    def __init__(self, handle: Any, board: Board) -> None:
        """``handle``: the engine deployment's handle (its router is a ``ResidencyRouter``
        writing on ``board``)."""
        self._handle = handle
        self._stream = handle.options(stream=True)
        self.board = board
        self._info: dict[str, Any] | None = None
        self._adapters: dict[str, dict[str, Any]] = {}
        # admin-loaded adapters: name -> (uri, digest, trusted)
        self._runtime: dict[str, tuple[str, str, bool]] = {}
        self._removed: set[str] = set()
        self._live: dict[str, Any] = {}  # request id -> its response generator
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._ids = itertools.count()
        self._reconciler: asyncio.Task | None = None
        self._closed = False

    # -- lifetime --------------------------------------------------------------------------------

    async def start(self) -> None:
        info = await self._handle.info.remote()
        self._info = info
        self._adapters = {a["name"]: dict(a) for a in info["adapters"]}
        self._reconciler = asyncio.get_running_loop().create_task(
            self._reconcile_forever(), name="loraplex-serve-ray-reconcile"
        )
        log.info("cluster_engine_started", model=info["model_name"], adapters=len(self._adapters))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for gen in list(self._live.values()):
            gen.cancel()
        if self._reconciler is not None:
            self._reconciler.cancel()
            await asyncio.gather(self._reconciler, return_exceptions=True)

    async def __aenter__(self) -> ClusterEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _got(self) -> dict[str, Any]:
        if self._info is None or self._closed:
            raise EngineClosedError("the engine is not running")
        return self._info

    # -- introspection (what the server code reads) ----------------------------------------------

    @property
    def model_name(self) -> str:
        return self._got()["model_name"]

    @property
    def model_root(self) -> str | None:
        return self._got()["model_root"]

    @property
    def max_model_len(self) -> int:
        return self._got()["max_model_len"]

    @property
    def tokenizer(self):  # Tokenizer | None
        return self._got()["tokenizer"]

    def tokenizer_for(self, adapter: AdapterChoice):  # Tokenizer | None
        """The tokenizer of requests on ``adapter``: the base's (the ingress encodes prompts;
        adapters that add tokens are not served through Ray: serve-ray refuses
        ``--lora-extra-vocab-size``)."""
        return self.tokenizer

    async def load_before_tokenizing(self, adapter: AdapterChoice) -> None:
        """Nothing to load first: no adapter here adds tokens (see ``tokenizer_for``)."""

    def capacity_report(self) -> dict[str, Any]:
        """One replica's capacity (every replica runs the same config)."""
        return dict(self._got()["capacity"])

    def list_adapters(self) -> list[dict[str, Any]]:
        self._got()
        return [dict(a) for a in self._adapters.values()]

    def stats(self) -> dict[str, Any]:
        """The replicas' latest stats merged (raises when no replica has reported)."""
        self._got()
        reports, _ = self.board.snapshot()
        if not reports:
            raise EngineClosedError("no engine replica is running")
        return _merge_stats(list(reports.values()))

    def replica_of(self, request_id: str) -> str | None:
        """The replica a request (engine request id) was sent to, if it was routed."""
        return self.board.replica_of(request_id)

    def subscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        """``fn("request_finished", data)`` for each request through this ingress, timed here
        (the replicas keep their own engine events and metrics)."""
        self._listeners.append(fn)

    def unsubscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self._listeners.remove(fn)

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        adapter: AdapterChoice = None,
        request_id: str | None = None,
        *,
        group: str | None = None,
        replica: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request from the replica the router picks (``replica``: that one);
        ``group`` as ``AsyncEngine.generate``'s (fair shares on the replica).

        A replica that fails before it acknowledged the request (``Accepted``: the request
        never reached its engine) is routed around: the request is sent again, at most
        ``_RETRIES`` times. One that fails after it, before the first output or mid-stream,
        fails the request with ``ReplicaFailedError`` (HTTP 503) and the request is never sent
        to another replica (it may be what killed this one). A request sent to ``replica`` is
        never sent elsewhere.
        """
        self._got()
        params = params or SamplingParams()
        rid = request_id or f"req-{next(self._ids)}"
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        kw = {} if replica is None else {"replica": replica}
        if replica is not None and replica not in self.board.snapshot()[0]:
            raise EngineClosedError(f"no engine replica {replica} is running")
        t0 = time.perf_counter()
        times: list[float] = []
        last: RequestOutput | None = None
        reason = "abort"
        gen = None
        try:
            for attempt in range(_RETRIES + 1):
                gen = self._stream.generate.remote(prompt, params, adapter, rid, group=group, **kw)
                self._live[rid] = gen
                accepted: Accepted | None = None
                try:
                    async for item in gen:
                        if isinstance(item, Accepted):
                            accepted = item  # from here on the request is never replayed
                            continue
                        if isinstance(item, WireError):
                            reason = "error"
                            raise item.exception()
                        if item.token_ids:
                            times.append(time.perf_counter())
                        last = item
                        yield item
                        if item.finished:
                            reason = item.finish_reason or "stop"
                            return
                    raise RuntimeError("the replica's stream ended before the request finished")
                except TaskCancelledError:
                    raise EngineClosedError("the request was aborted") from None
                except RayError as e:
                    # (the request id and the replica only: the request's content stays out of
                    # the log, it may be an attack)
                    failed = self.board.replica_of(rid)
                    error = type(e).__name__
                    reached = accepted is not None or last is not None
                    if reached or attempt == _RETRIES or kw or self._closed:
                        reason = "error"
                        log.warning(
                            "replica_failed", request_id=rid, replica=failed, error=error,
                            acknowledged=reached, pid=accepted.pid if accepted else None,
                            started=last is not None, attempts=attempt + 1,
                        )  # fmt: skip
                        raise ReplicaFailedError(
                            f"the engine replica serving this request failed ({error})"
                        ) from None
                    log.info(
                        "replica_unreached_rerouting", request_id=rid, replica=failed,
                        error=error, attempt=attempt,
                    )  # fmt: skip
                    await asyncio.sleep(_RETRY_PAUSE_S * (attempt + 1))
        finally:
            self._live.pop(rid, None)
            if gen is not None and (last is None or not last.finished):
                gen.cancel()  # the replica aborts the engine request
            self._finished(residency_key(adapter), reason, last, t0, times)

    def _finished(
        self,
        adapter: str | None,
        reason: str,
        last: RequestOutput | None,
        t0: float,
        times: list[float],
    ) -> None:
        if not self._listeners:
            return
        data = {
            "adapter": adapter,
            "finish_reason": reason,
            "prompt_tokens": last.num_prompt_tokens if last is not None else 0,
            "output_tokens": last.num_output_tokens if last is not None else 0,
            "ttft_s": times[0] - t0 if times else None,
            "e2e_s": time.perf_counter() - t0,
            "itl_s": [b - a for a, b in itertools.pairwise(times)],
        }
        for fn in list(self._listeners):
            fn("request_finished", data)

    def abort(self, request_id: str) -> bool:
        gen = self._live.get(request_id)
        if gen is None:
            return False
        gen.cancel()
        return True

    # -- adapters --------------------------------------------------------------------------------

    def _replicas(self) -> list[str]:
        reports, _ = self.board.snapshot()
        return sorted(reports)

    async def _on(self, replica: str, method: str, *args: Any) -> Any:
        """``method(*args)`` on ``replica``. Fails with ReplicaFailedError as soon as the
        replica leaves the board (Ray's router no longer has it: the call could never be
        routed) and with TimeoutError after ``_CALL_TIMEOUT_S``; either way the call is
        cancelled, so that it does not hold one of Ray's routing tasks for ever. A caller
        that is cancelled leaves the call running (an adapter load finishes on its replica)."""
        call = getattr(self._handle, method).remote(*args, replica=replica)
        task = asyncio.ensure_future(_result(call))
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while True:
            done, _ = await asyncio.wait({task}, timeout=_LIVENESS_POLL_S)
            if done:
                try:
                    return task.result()
                except MisroutedCallError:  # the router had lost it: sent to another replica
                    raise ReplicaFailedError(
                        f"engine replica {replica} is gone ({method} not delivered)"
                    ) from None
            if replica not in self.board.snapshot()[0]:
                err: Exception = ReplicaFailedError(
                    f"engine replica {replica} is gone ({method} not delivered)"
                )
            elif time.monotonic() > deadline:
                err = TimeoutError(f"engine replica {replica}: {method} took over "
                                   f"{_CALL_TIMEOUT_S:.0f} s")  # fmt: skip
            else:
                continue
            call.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise err

    async def add_adapter(
        self, name: str, uri: str, sha256: str | None = None, *, trusted: bool = True
    ) -> dict[str, Any]:
        """Load on every live replica; the first replica's error fails the call (nothing is
        kept anywhere then)."""
        self._got()
        replicas = self._replicas()
        if not replicas:
            raise EngineClosedError("no engine replica is running")
        first = await self._on(replicas[0], "add_adapter", name, uri, sha256, trusted)
        if isinstance(first, WireError):
            raise first.exception()
        rest = await asyncio.gather(
            *(
                self._on(r, "add_adapter", name, uri, first["digest"], trusted)
                for r in replicas[1:]
            ),
            return_exceptions=True,
        )
        failed = [x for x in rest if isinstance(x, (WireError, BaseException))]
        if failed:
            await asyncio.gather(
                *(self._on(r, "remove_adapter", name) for r in replicas), return_exceptions=True
            )
            err = failed[0]
            raise err.exception() if isinstance(err, WireError) else err
        self._runtime[name] = (uri, first["digest"], trusted)
        self._removed.discard(name)
        self._adapters[name] = {"name": name, "uri": uri, "digest": first["digest"], "state": ""}
        return first

    async def remove_adapter(self, name: str) -> None:
        self._got()
        if name not in self._adapters:
            raise AdapterNotFoundError(f"unknown adapter {name!r}", field="lora_name")
        results = await asyncio.gather(
            *(self._on(r, "remove_adapter", name) for r in self._replicas()), return_exceptions=True
        )
        self._adapters.pop(name, None)
        self._runtime.pop(name, None)
        self._removed.add(name)
        for res in results:
            if isinstance(res, WireError) and not issubclass(
                type(res.exception()), AdapterNotFoundError
            ):
                raise res.exception()

    async def _reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(_RECONCILE_S)
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - retried on the next turn
                log.exception("adapter_reconcile_failed")

    async def reconcile(self) -> None:
        """Give every replica the runtime adapters it lacks, take removed ones away (a
        replacement replica starts with the static adapters only)."""
        reports, _ = self.board.snapshot()
        for replica, report in reports.items():
            have = set(report.get("adapters", ()))
            for name in sorted(set(self._runtime) - have):
                uri, digest, trusted = self._runtime[name]
                res = await self._on(replica, "add_adapter", name, uri, digest, trusted)
                ok = not isinstance(res, WireError)
                log.info("adapter_reconciled", replica=replica, name=name, ok=ok)
            for name in sorted(self._removed & have):
                await self._on(replica, "remove_adapter", name)


async def _result(call: Any) -> Any:
    return await call
