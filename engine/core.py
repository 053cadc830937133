"""EngineCore: the engine's state and the one owner of its requests, driven by AsyncEngine.

The core holds the scheduler and KV blocks, the adapters (manager and cold-load pipeline), the
requests in flight, counters and event listeners, and a ``StepExecutor`` (executor.py) that
runs steps on the device. Start-up (model, KV cache, tokenizer, graphs) is
``startup.build_core``; nothing here imports it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from loraplex.engine.adapters.fetch import AdapterFetcher
from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.registry import AdapterRegistry, AdapterState, AdapterVersion
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.adapters.slot_writer import InlineWriter, SlotWriter, ThreadWriter
from loraplex.engine.config import EngineConfig
from loraplex.engine.core_adapters import MAX_COMPOSITION, AdapterOps
from loraplex.engine.core_steps import Planned, StepOps
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.errors import AdapterNotFoundError, InvalidRequestError
from loraplex.engine.executor import StepExecutor, StepRecord
from loraplex.engine.kv import BlockManager
from loraplex.engine.loop_lag import LoopLag
from loraplex.engine.mixed_graphs import MixedGraphs
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model.tp import full_config
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.observe import request_summary
from loraplex.engine.output import final_output
from loraplex.engine.request import Request
from loraplex.engine.sampler import make_generator
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.structured.grammars import GrammarCache, Guide
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.engine.tokenizer import Tokenizer
from loraplex.engine.warmup import COMPILES, warm_slot_writes

__all__ = ["EngineCore", "EngineInternals", "Planned", "AdapterChoice", "MAX_COMPOSITION"]

# What a request runs on: None (the base model), an adapter name, or a composition of
# adapters with weights, e.g. [("sql", 0.7), ("pirate", 0.3)].
AdapterChoice = str | Sequence[tuple[str, float]] | None

log = structlog.get_logger("loraplex.engine")


def slot_writer(config: EngineConfig, runner: ModelRunner, pool: HostPool | None) -> SlotWriter:
    """The engine's slot writer (adapters/slot_writer.py): a thread and side stream on CUDA
    with one rank and a host pool (warmed now: one full-size write and a clear), else writes
    inline in the step thread (the CPU, tensor parallelism)."""
    device = runner.device
    if device.type == "cuda" and runner.tp_size == 1 and pool is not None and config.max_loras:
        stream = torch.cuda.Stream(device)
        warm_slot_writes(runner.slot_buffers, pool, stream)
        return ThreadWriter(runner.write_slot, stream, pool)
    return InlineWriter(runner.write_slot, pool)


@dataclass(frozen=True)
class EngineInternals:
    """What tests and benchmarks may read or wrap of a running engine (``AsyncEngine.testing``).

    Not an application API: it follows the engine's inner structure.
    ``scheduler``: queues (``running``, ``waiting``), ``schedule`` / ``add``;
    ``adapters``: versions, slots, refcounts; ``loader``: plugins, helper processes, host pool,
    staging dir; ``executor``: ``prepare`` / ``launch``, ``runner``, ``model``,
    ``mixed_graphs`` and the ``step_log`` of ``StepRecord``.
    """

    scheduler: Scheduler
    adapters: AdapterRegistry
    loader: AdapterFetcher
    executor: StepExecutor

    @property
    def step_log(self) -> collections.deque[StepRecord]:
        return self.executor.step_log


class EngineCore(AdapterOps, StepOps):
    """The engine's state: scheduler, KV blocks, adapters, requests; ``executor`` runs steps.

    ``AsyncEngine`` uses only this API, on the event loop unless noted:

    - lifetime: ``start()`` (on the running loop: loop-lag sampling), ``await close()``;
    - requests: ``submit(request_id, prompt, params, adapter)`` -> the queued ``Request``
      (typed errors for unknown adapters and bad prompts); ``abort(req)`` -> True when it
      finished now, False when a step in flight holds it (that step's ``apply`` ends it);
    - steps: ``plan()`` -> the next ``Planned`` step, or None when nothing can run (then
      ``pending_slot_writes()`` says whether a slot write is about to land);
      ``launch(plan, items, prev)`` and ``collect(step)`` in the step thread;
      ``chain(step)`` -> the ``Planned`` step to queue behind ``step`` while it is in flight
      (pipelined decode), or None; ``apply(step, result, behind)`` a collected step;
      ``end_steps()`` when the loop leaves its steps (also on errors and cancellation);
      ``fail_steps(plans, error)`` / ``fail_all(error)`` when a step / the loop fails;
    - adapters: ``add_adapter``, ``remove_adapter``, ``pin_adapter``, ``list_adapters``;
    - observing: ``subscribe(fn)`` / ``unsubscribe(fn)``, ``stats()``; ``model_name``,
      ``tokenizer``, ``max_model_len``; ``internals`` (the testing hook).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        runner: ModelRunner,
        tokenizer: Tokenizer | None,
        wake: Callable[[], None],
        pool: HostPool | None = None,
        mixed_graphs: MixedGraphs | None = None,
    ) -> None:
        self.config = config
        self.model = model  # read for its config, dtype and device; run by the executor
        self.tokenizer = tokenizer
        self.device = model.device
        cfg = self.model_config = full_config(model)  # (model.cfg: a TP rank's shard)
        self.model_name = config.served_model_name or config.model or "model"
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer else set(cfg.eos_token_ids)
        self.loader = AdapterFetcher(config, cfg, pool=pool)
        if tokenizer is not None:  # adapters that add tokens bring their own (added_tokens.py)
            self.loader.base_tokenizer = tokenizer.backend
            self.loader.load_tokenizer = self._adapter_tokenizer
        self.slots = SlotStore(
            config.max_loras,
            config.max_full_module_loras,
            writer=slot_writer(config, runner, pool),
            ranks=runner.slot_ranks,
            pool=pool,
            generation=runner.slot_buffers.generation,
        )
        self.adapters = AdapterRegistry(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            loader=self._load_adapter,
            max_full=config.max_full_module_loras,
            on_change=wake,
            on_drop=self.loader.discard,
            on_unload=self.loader.stager.release,
            slots=self.slots,
        )
        self.loader.stager.make_room = self.adapters.make_room
        self.blocks = BlockManager(
            runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.blocks, self.adapters, self.slots)
        self.executor = StepExecutor(
            config, model, runner, self.blocks, self.slots, self.adapters.any_loading, mixed_graphs
        )
        self.in_flight: set[Request] = set()  # requests of launched, not yet applied steps
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "errors": 0, "steps": 0}
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._load_gate: asyncio.Semaphore | None = None
        self.loop_lag: LoopLag | None = None  # started by ``start`` on the engine's loop
        self.grammars = (
            GrammarCache(
                tokenizer.backend.to_str,
                cfg.vocab_size + config.lora_extra_vocab_size,  # the logits' width
                sorted(self.eos_ids),
                compile_timeout_s=config.grammar_compile_timeout_s,
                cache_bytes=config.grammar_cache_bytes,
                processes=config.grammar_compile_processes,
            )
            if tokenizer is not None
            else None
        )

    def _adapter_tokenizer(self, folder: Path) -> Tokenizer:
        """An adapter's own tokenizer (it added tokens; loader thread): without a chat template
        of its own, the base's."""
        tok = Tokenizer.from_dir(folder)
        if tok.chat_template is None and self.tokenizer is not None:
            tok.chat_template = self.tokenizer.chat_template
        return tok

    def tokenizer_for(self, adapter: AdapterChoice) -> Tokenizer | None:
        """The tokenizer of requests on ``adapter`` (a name): an adapter that added tokens has
        its own (known once it is loaded ahead), every other request the base's."""
        if isinstance(adapter, str):
            with contextlib.suppress(AdapterNotFoundError):
                v = self.adapters.get(adapter)
                if v.tokenizer is not None:
                    return v.tokenizer
        return self.tokenizer

    @property
    def internals(self) -> EngineInternals:
        return EngineInternals(self.scheduler, self.adapters, self.loader, self.executor)

    # -- lifetime and events --------------------------------------------------------------------

    def start(self) -> None:
        """On the engine's running loop: sample its lag (``loop_lag`` events, stats)."""
        self.loop_lag = LoopLag(lambda lag: self.emit("loop_lag", lag_s=lag))
        self.loop_lag.start()

    async def close(self) -> None:
        """Stop lag sampling, cancel loads, stop the slot writer and the loader."""
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        tasks = [v.load_task for v in self.adapters.versions() if v.load_task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.slots.close)  # (the slot writer's thread first)
        await asyncio.to_thread(self.executor.close)
        if self.grammars is not None:
            await asyncio.to_thread(self.grammars.close)
        await asyncio.to_thread(self.loader.close)

    def subscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        self.listeners.append(fn)

    def unsubscribe(self, fn: Callable[[str, dict[str, Any]], None]) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)

    def emit(self, event: str, **data: Any) -> None:
        """Tell subscribers (metrics, studies) about ``event``; a failing one is logged, not raised."""
        for fn in self.listeners:
            try:
                fn(event, data)
            except Exception:  # noqa: BLE001
                log.exception("listener_failed", event=event)

    # -- requests -------------------------------------------------------------------------------

    async def guide(self, spec: StructuredOutput) -> Guide:
        """A matcher for a structured-output request (compiled off the loop, cached)."""
        if self.grammars is None:
            raise InvalidRequestError(
                "structured output needs the model's tokenizer", field=spec.field
            )
        return await self.grammars.guide(spec)

    def submit(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        adapter: AdapterChoice = None,
        guide: Guide | None = None,
        group: str | None = None,
    ) -> Request:
        """Check and queue a request; raises typed errors (unknown adapter, bad prompt...).
        ``adapter``: a name, or a composition [(name, weight), ...] (``AdapterChoice``);
        ``guide``: its matcher when ``params.structured`` is set (``guide()``); ``group``: the
        fair-share group (``Request.group``; None: its own)."""
        if adapter is None:
            version = None
        elif isinstance(adapter, str):
            version = self._resolve_adapter(adapter)
        else:
            version = self._resolve_composition(adapter)
        try:
            own = version.tokenizer if version is not None else None  # it added tokens
            if own is not None and guide is not None:
                raise InvalidRequestError(
                    f"structured output (response_format, tools) is not supported on adapter "
                    f"{version.name!r}: it adds tokens to the vocabulary",
                    field="response_format",
                )
            prompt_ids = self._encode_prompt(prompt, params, version)
            req = Request(
                request_id, prompt_ids, params, version,
                eos_ids=frozenset(self.eos_ids), group=group or "",
            )  # fmt: skip
            req.guide = guide
            if params.seed is not None:
                req.generator = make_generator(params.seed, self.device)
            req.detok = self._detokenizer(req)
        except BaseException:
            if version is not None:
                self._drop_unused_adapter(version)  # a rejected request registers no name
            raise
        if version is not None:
            req.meta["tier"] = self.adapters.add_user(version)
        self.counters["requests"] += 1
        self.scheduler.add(req)
        return req

    def abort(self, req: Request) -> bool:
        """Mark ``req`` aborted; True if it finished now, False if a step in flight holds it
        (applying that step finishes it)."""
        req.aborted = True
        if req in self.in_flight:
            return False
        self.finish(req, "abort")
        return True

    def _encode_prompt(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        version: AdapterVersion | None = None,
    ) -> list[int]:
        own = version.tokenizer if version is not None else None  # an adapter's added tokens
        tokenizer = own if own is not None else self.tokenizer
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: send token ids", field="prompt"
                )
            ids = tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = version.vocab_rows if own is not None else self.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError(
                    f"prompt token ids must lie in [0, {vocab})", field="prompt"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"maximum context length {self.max_model_len}",
                field="max_tokens",
            )
        if self.blocks.blocks_needed(len(ids) + params.max_tokens) > self.blocks.num_blocks:
            raise InvalidRequestError(
                "the request does not fit in the KV cache", field="max_tokens"
            )
        return ids

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer | None:
        own = req.adapter.tokenizer if req.adapter is not None else None  # added tokens
        tokenizer = own if own is not None else self.tokenizer
        if tokenizer is None:
            return None
        return IncrementalDetokenizer(tokenizer, req.prompt_ids, stop=req.params.stop)

    def finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        self.scheduler.finish(req, reason)
        self.counters["aborted" if reason == "abort" else "finished"] += 1
        req.queue.put_nowait(final_output(req, reason, error))
        self._log(req)

    def fail(self, req: Request, error: BaseException) -> None:
        self.counters["errors"] += 1
        self.finish(req, "error", error)

    def fail_all(self, error: BaseException) -> None:
        """Fail every queued and running request (the step loop hit an unexpected error)."""
        self.in_flight.clear()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self.fail(req, error)

    def _log(self, req: Request) -> None:
        """The one canonical log line of a request, and the matching event for subscribers."""
        summary = request_summary(req)
        log.info("request", **summary)
        times = req.token_times
        self.emit(
            "request_finished", **summary, itl_s=[b - a for a, b in itertools.pairwise(times)]
        )

    # -- introspection --------------------------------------------------------------------------

    def adapter_residency(self) -> list[dict[str, Any]]:
        """``AsyncEngine.adapter_residency``: versions in a GPU slot or the CPU tier."""
        registry = self.adapters
        current = {id(registry.get(n)) for n in registry.names()}
        rows = []
        for v in registry.versions():
            gpu = self.slots.slot_of(v) is not None
            if not gpu and v.state is not AdapterState.CPU:
                continue  # (a version in a GPU slot stays in the CPU tier)
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

    def stats(self) -> dict[str, Any]:
        """Counters for tests, metrics and studies (read on the event loop)."""
        b = self.blocks
        sched = self.scheduler
        adapters = self.adapters
        return {
            "max_loras": self.config.max_loras,
            "running_adapters": sorted({r.adapter.name for r in sched.running if r.adapter}),
            "waiting_adapters": sorted({r.adapter.name for r in sched.waiting if r.adapter}),
            "gpu_resident": [v.name for v in self.slots.resident],
            "cpu_resident": [v.name for v in adapters.versions() if v.state is AdapterState.CPU],
            "num_blocks": b.num_blocks,
            "num_free_blocks": b.num_free_blocks,
            "num_used_blocks": b.num_used_blocks,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "preemptions": sched.num_preemptions,
            "prefix_cache_queries": b.stats.queries,
            "prefix_cache_hits": b.stats.hits,
            "adapter_refs": {
                f"{v.name}@{v.digest[:12]}#{v.version}": {  # unique: digests may be pending
                    "users": v.users,
                    "slot_refs": self.slots.refs(v),
                    "slot": self.slots.slot_of(v),
                }
                for v in adapters.versions()
            },
            "adapters": dict(adapters.stats),
            "kernel_compiles_while_serving": len(COMPILES.while_serving),
            "host_pool_regions_in_use": self.loader.pool.in_use() if self.loader.pool else 0,
            **(self.loop_lag.summary() if self.loop_lag is not None else {}),
            **self.counters,
        }
