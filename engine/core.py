"""EngineCore: the synchronous heart of the engine, driven by AsyncEngine's loop task.

Methods run on the event loop except ``execute`` (the worker thread) and ``build``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.cuda_graph import MixedGraphs
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.kv import BlockManager
from loraplex.engine.loop_lag import LoopLag
from loraplex.engine.lora.errors import AdapterNotFoundError
from loraplex.engine.lora.loader import AdapterLoader
from loraplex.engine.lora.manager import AdapterManager, AdapterState, AdapterVersion
from loraplex.engine.lora.pool import HostPool
from loraplex.engine.lora.slot_writer import SlotWriter
from loraplex.engine.lora.staging import packed_for
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.observe import engine_stats, request_summary
from loraplex.engine.output import final_output
from loraplex.engine.request import Request
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.engine.step import StepMixin
from loraplex.engine.tokenizer import Tokenizer
from loraplex.engine.warmup import warm_slot_writes

__all__ = ["EngineCore"]

log = structlog.get_logger("loraplex.engine")


class EngineCore(StepMixin):
    def __init__(
        self,
        config: EngineConfig,
        model,
        runner: ModelRunner,
        tokenizer,
        wake,
        pool: HostPool | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.runner = runner
        self.tokenizer: Tokenizer | None = tokenizer
        self.device = model.device
        cfg = model.cfg
        self.model_name = config.served_model_name or (
            "demo" if config.extra.get("demo") else (config.model or "model")
        )
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer else set(cfg.eos_token_ids)
        self.loader = AdapterLoader(config, cfg, pool=pool)
        self.adapters = AdapterManager(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            loader=self._load_adapter,
            on_change=wake,
            on_drop=self.loader.discard,
            on_unload=self.loader.release,
        )
        self.loader.make_room = self.adapters.make_room
        self.blocks = BlockManager(
            runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.blocks, self.adapters)
        self.sampler = Sampler(seed=config.seed)
        self.in_flight: set[Request] = set()
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.slot_writer: SlotWriter | None = None
        if self.side_stream is not None and pool is not None and config.max_loras:
            warm_slot_writes(model, pool, self.side_stream)
            self.slot_writer = SlotWriter(model, self.side_stream)
        self.last_step_event: Any = None
        self.last_result_time = 0.0  # perf_counter when the last step's tokens reached the host
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "errors": 0, "steps": 0}
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._load_gate: asyncio.Semaphore | None = None
        self.step_log: collections.deque[tuple] = collections.deque(maxlen=100_000)
        self.loop_lag: LoopLag | None = None  # started by AsyncEngine on its loop
        self.mixed_graphs: MixedGraphs | None = None  # set by start-up (CUDA graphs on)

    def loop_lag_summary(self) -> dict[str, float]:
        return self.loop_lag.summary() if self.loop_lag is not None else {}

    def emit(self, event: str, **data: Any) -> None:
        """Tell subscribers (metrics, studies) about ``event``; a failing one is logged, not raised."""
        for fn in self.listeners:
            try:
                fn(event, data)
            except Exception:  # noqa: BLE001
                log.exception("listener_failed", event=event)

    @staticmethod
    def build(config: EngineConfig, wake: Callable[[], None], model: Any = None) -> EngineCore:
        """Load model, KV cache and tokenizer (blocking: call from a worker thread)."""
        from loraplex.engine.startup import build_core

        return build_core(config, wake, model)

    def capacity_report(self) -> dict[str, Any]:
        from loraplex.engine.startup import capacity_report

        return capacity_report(self)

    # -- adapters -------------------------------------------------------------------------------

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
            self.loader.allow_static(uri)
        v = self.adapters.new_version(name, uri)
        v.trusted = trusted
        await self.loader.fetch_verify(v, sha256, trusted=trusted)
        v = self.adapters.register(v)
        await self.loader.trim_staging(self.adapters.versions(), keep=v)
        return v

    def resolve_adapter(self, name: str) -> AdapterVersion:
        """The current version of ``name``; unknown names go through dynamic resolution."""
        try:
            return self.adapters.get(name)
        except AdapterNotFoundError:
            uri = self.loader.dynamic_uri(name) if self.config.max_loras else None
            if uri is None:
                raise
        v = self.adapters.new_version(name, uri, dynamic=True)
        return self.adapters.register(v)

    def drop_unused_adapter(self, v: AdapterVersion) -> None:
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
            if v.local_dir is not None and not await asyncio.to_thread(v.local_dir.is_dir):
                log.warning("adapter_staging_lost", name=v.name, path=str(v.local_dir))
                v.local_dir = None  # fetched again below; the digest must not change
            if v.local_dir is None:
                await self.loader.fetch_verify(v, trusted=v.trusted)
                await self.loader.trim_staging(self.adapters.versions(), keep=v)
            v.adapter = await self.loader.stage(v, self.model.dtype, pin=self.device.type == "cuda")
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

    async def adapters_close(self) -> None:
        tasks = [v.load_task for v in self.adapters.versions() if v.load_task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.slot_writer is not None:
            await asyncio.to_thread(self.slot_writer.close)
        await asyncio.to_thread(self.loader.close)

    def drain_failed_adapters(self) -> list[tuple[Request, BaseException]]:
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

    def poll_slot_events(self) -> None:
        for v in self.adapters.resident:
            if not v.slot_ready and v.slot_event is not None and v.slot_event.query():
                self._slot_landed(v)

    def pending_slot_writes(self) -> bool:
        """A slot was handed out and its write has not landed (or not been issued) yet."""
        return any(not v.slot_ready and v.adapter is not None for v in self.adapters.resident)

    def _slot_landed(self, v: AdapterVersion) -> None:
        gpu_s = copy_s = None
        if v.slot_timing is not None and v.slot_event is not None:
            start, copied = v.slot_timing
            gpu_s = start.elapsed_time(v.slot_event) / 1e3  # transfer + on-device scatter
            copy_s = start.elapsed_time(copied) / 1e3  # the host -> device transfer alone
        v.slot_ready, v.slot_event, v.slot_timing = True, None, None
        self.runner.slot_ranks[v.slot] = v.rank
        h2d = time.perf_counter() - v.timings.get("h2d_start", time.perf_counter())
        v.timings["h2d"] = h2d
        nbytes = v.adapter.nbytes if v.adapter is not None else 0
        packed = packed_for(v.adapter) if v.adapter is not None else None
        self.emit(
            "slot_write", name=v.name, digest=v.digest, slot=v.slot, h2d_s=h2d, nbytes=nbytes,
            copy_bytes=packed.nbytes if packed is not None else nbytes, h2d_gpu_s=gpu_s,
            h2d_copy_s=copy_s,
        )  # fmt: skip

    # -- requests -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer: send token ids", field="prompt"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.model.cfg.vocab_size
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

    def make_detokenizer(self, req: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, req.prompt_ids, stop=req.params.stop)

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
        self.in_flight = set()
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            self.fail(req, error)

    def fail_step(self, plan: SchedulerOutput, error: BaseException) -> None:
        for chunk in plan.chunks:
            if not chunk.req.is_finished:  # pipelined steps share requests
                self.fail(chunk.req, error)

    def _log(self, req: Request) -> None:
        """The one canonical log line of a request, and the matching event for subscribers."""
        summary = request_summary(req)
        log.info("request", **summary)
        times = req.token_times
        self.emit(
            "request_finished", **summary, itl_s=[b - a for a, b in itertools.pairwise(times)]
        )

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return engine_stats(self)
