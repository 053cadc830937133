"""AsyncEngine: the embeddable engine. One asyncio task runs the step loop; the blocking
step (slot writes, tensors, forward, sampling) runs in one worker thread so the event loop
stays free. Only the loop task steps the engine; everything goes through ``EngineCore``'s API.

    async with AsyncEngine(EngineConfig(model=...)) as engine:
        async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=8), adapter="sql"):
            print(out.text, end="")
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import AdapterChoice, EngineCore, EngineInternals, Planned
from loraplex.engine.errors import EngineClosedError, InvalidRequestError
from loraplex.engine.executor import InFlightStep
from loraplex.engine.intake import Intake
from loraplex.engine.request import Request, RequestOutput
from loraplex.engine.sampler import SamplerOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.startup import build_core, capacity_report
from loraplex.engine.warmup import COMPILES

__all__ = ["AsyncEngine"]

log = structlog.get_logger("loraplex.engine")


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, model: Any = None) -> None:
        """``model``: optionally a ready model (random-weight benchmarks, apps that build
        their own) with ``config.max_loras`` LoRA slots of rank ``config.max_lora_rank``; the
        checkpoint in ``config.model`` is then not loaded."""
        self.config = config
        self._model = model
        self._engine_core: EngineCore | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loraplex-step")
        self._loop_task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._intake = Intake()
        self._closed = False

    # -- lifetime -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.gil_switch_interval_s
        if interval is not None and sys.getswitchinterval() > interval:
            # NOTE: CPython hands the GIL over every 5 ms by default; a staging thread in
            # Python code would then hold the step thread for 5 ms at a time (process-wide)
            sys.setswitchinterval(interval)
        self._engine_core = await loop.run_in_executor(
            self._executor, build_core, self.config, self._wake.set, self._model
        )
        self._model = None
        # NOTE: start-up leaves ~10^5 long-lived objects (modules, tensors, graphs); frozen,
        # the cyclic GC no longer walks them, so a collection mid-stream costs µs, not ms
        gc.collect()
        gc.freeze()
        COMPILES.serving()  # from here on a Triton compile stalls streams: each is logged
        self._engine_core.start()
        self._loop_task = loop.create_task(self._run(), name="loraplex-step-loop")
        log.info("engine_started", **capacity_report(self._engine_core))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for req in list(self._requests.values()):
            self.abort(req.request_id)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        gc.unfreeze()  # (what start-up froze is collectable again once the engine is gone)
        if self._engine_core is not None:
            await self._engine_core.close()
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _core(self) -> EngineCore:
        if self._engine_core is None or self._closed:
            raise EngineClosedError("the engine is not running")
        return self._engine_core

    # -- introspection ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._core().model_name

    @property
    def model_root(self) -> str | None:
        """The base model's folder (the demo model's once started without one), else None."""
        core = self._engine_core
        model = core.config.model if core is not None else self.config.model
        return str(model) if model is not None else None

    @property
    def tokenizer(self):  # Tokenizer | None: None means token-id prompts only
        return self._core().tokenizer

    def tokenizer_for(self, adapter):  # Tokenizer | None
        """The tokenizer of requests on ``adapter`` (a name, or None: the base): an adapter
        that added tokens (``lora_extra_vocab_size``) has its own, others the base's."""
        return self._core().tokenizer_for(adapter)

    @property
    def max_model_len(self) -> int:
        return self._core().max_model_len

    def subscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        """Call ``fn(event, data)`` on engine events: "request_finished", "adapter_load",
        "slot_write", "loop_lag" (every few ms: ``lag_s``)."""
        self._core().subscribe(fn)

    def unsubscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self._core().unsubscribe(fn)

    def capacity_report(self) -> dict[str, Any]:
        return capacity_report(self._core())

    @property
    def testing(self) -> EngineInternals:
        """The one hook of tests and benchmarks into a running engine's internals: step log,
        scheduler, the adapter side (registry, slots, fetcher, host pool), step executor (see
        ``EngineInternals``).
        Applications use the methods of this class; the hook follows the internals."""
        return self._core().internals

    # -- adapters -------------------------------------------------------------------------------

    async def add_adapter(
        self, name: str, uri: str, sha256: str | None = None, *, trusted: bool = True
    ) -> dict[str, Any]:
        """Register an adapter by operator-given source; verifies ``sha256`` if given.

        ``trusted=False`` (runtime loads) keeps the source inside the allowlist policy.
        """
        core = self._core()
        await self._intake.turn()  # a burst of calls: one at a time, spaced (intake.py)
        v = await core.adapters.add(name, uri, sha256, trusted=trusted)
        return {"name": v.name, "uri": v.uri, "digest": v.digest, "version": v.version}

    async def remove_adapter(self, name: str) -> None:
        self._core().adapters.remove(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        """Keep ``name`` in its GPU slot once loaded (operator pin)."""
        self._core().adapters.pin(name, pinned)

    def list_adapters(self) -> list[dict[str, Any]]:
        return self._core().adapters.list()

    def adapter_residency(self) -> list[dict[str, Any]]:
        """Every adapter version in memory (a GPU slot or the CPU tier): ``name``, ``digest``,
        ``tier`` ("gpu": holds a GPU slot, and stays in the CPU tier; "cpu"), ``pinned``,
        ``rank``, ``nbytes`` (its LoRA tensors in host memory) and ``current`` (the current
        version of its name). Read on the engine's loop (``/metrics``)."""
        return self._core().adapters.residency()

    # -- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        adapter: AdapterChoice = None,
        request_id: str | None = None,
        *,
        group: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; raises typed errors (unknown adapter, bad prompt...).

        ``group``: requests sent for one caller request (its ``n`` choices, its prompts) name
        one group; while several groups wait, each gets a fair share of ``max_num_seqs``
        (scheduler.py). None: the request is a group of its own.

        ``adapter``: None (the base model), an adapter name, or a composition of adapters with
        weights, ``[("sql", 0.7), ("pirate", 0.3)]``: the weighted sum of their deltas, as
        PEFT's ``add_weighted_adapter(..., combination_type="cat")`` (one slot of the summed
        rank, cached by names + digests + weights)."""
        core = self._core()
        await self._intake.turn()  # a burst of calls: one at a time, spaced (intake.py)
        params = params or SamplingParams()
        guide = None
        if params.structured is not None:  # compiled in the grammar threads (cached)
            guide = await core.guide(params.structured)
            self._core()  # (closed meanwhile: EngineClosedError)
        await core.adapters.load_before_tokenizing(adapter)  # (adapters that may add tokens)
        core = self._core()
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", field="request_id")
        req = core.submit(rid, prompt, params, adapter, guide, group)
        self._requests[rid] = req
        self._wake.set()
        try:
            while True:
                out = await req.queue.get()
                if out.error is not None:
                    raise out.error
                yield out
                if out.finished:
                    return
        finally:
            if not req.is_finished:
                self.abort(rid)

    async def load_before_tokenizing(self, adapter: AdapterChoice) -> None:
        """Callers that tokenize prompts themselves (the server) await this first: where
        adapters may add tokens (``lora_extra_vocab_size`` > 0) a name resolved at request
        time is loaded now, so that ``tokenizer_for`` gives its own tokenizer; otherwise a
        no-op. Raises the load's typed error (unknown name, refused adapter)."""
        await self._core().adapters.load_before_tokenizing(adapter)

    def abort(self, request_id: str) -> bool:
        """Abort a request; returns False if it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished or self._engine_core is None:
            return False
        if self._engine_core.abort(req):  # else it ends when its step in flight is applied
            self._requests.pop(request_id, None)
        self._wake.set()
        return True

    def stats(self) -> dict[str, Any]:
        return self._core().stats()

    # -- loop -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        core = self._core()
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self._iterate(core, loop)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a bug must fail requests, never hang them
                log.exception("engine_loop_error")
                core.fail_all(e)
                self._requests = {k: r for k, r in self._requests.items() if not r.is_finished}

    async def _iterate(self, core: EngineCore, loop: asyncio.AbstractEventLoop) -> None:
        """One turn of the step loop: plan, run the step in the worker thread, apply it.

        Pipelined decode: while a step is in flight, the next one (same requests, one token
        further) is planned and launched behind it before its tokens are collected, for as
        long as ``core.chain`` allows; then the loop schedules normally again.
        """
        self._wake.clear()
        drafting = core.drafting()  # a draft model proposes in the step thread, not here
        if drafting:
            await loop.run_in_executor(self._executor, core.propose_ahead, drafting)
        planned = core.plan()
        if planned is None:
            if core.adapters.pending_writes():
                await asyncio.sleep(0.0005)  # a side-stream write is landing
            else:
                await self._wake.wait()
            return
        plan, items = planned
        plans = [plan]
        try:
            step = await loop.run_in_executor(self._executor, core.launch, plan, items)
            while not self._closed:
                nxt = core.chain(step)
                if nxt is None:
                    break
                plans.append(nxt[0])
                nstep, result = await loop.run_in_executor(
                    self._executor, self._launch_collect, core, nxt, step
                )
                plans.pop(0)
                core.apply(step, result, behind=nstep)
                self._forget_finished()
                step = nstep
                await asyncio.sleep(0)  # let consumers take their outputs
            result = await loop.run_in_executor(self._executor, core.collect, step)
        except Exception as e:  # noqa: BLE001 - one bad step must not stop the engine
            log.exception("step_failed")
            core.fail_steps(plans, e)
            return
        finally:
            core.end_steps()
        core.apply(step, result)
        self._forget_finished()
        await asyncio.sleep(0)

    @staticmethod
    def _launch_collect(
        core: EngineCore, nxt: Planned, step: InFlightStep
    ) -> tuple[InFlightStep, SamplerOutput | None]:
        """Step thread: queue the next step behind ``step``, then wait for ``step``'s tokens."""
        nstep = core.launch(nxt[0], nxt[1], step)
        return nstep, core.collect(step)

    def _forget_finished(self) -> None:
        for req in [r for r in self._requests.values() if r.is_finished]:
            self._requests.pop(req.request_id, None)
