"""Run one API request on the engine: n choices × prompts as engine requests, outputs merged.

Every engine request still running when the consumer stops (client gone, error, handler
cancelled) is aborted, so its KV blocks and adapter references are released at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from loraplex.engine.adapters.lifecycle import AdapterChoice
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.server.drain import Drain
from loraplex.engine.server.errors import APIError, from_exception
from loraplex.engine.server.protocol import GenerationRequest
from loraplex.engine.server.state import PREP_POOL_KEY

__all__ = ["Job", "FanOut", "Choice", "Reply", "adapter_for", "make_jobs", "usage", "off_loop"]

T = TypeVar("T")


async def off_loop(request: web.Request, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` in the app's preparation threads (tokenization, chat templates).

    NOTE: a small pool: a burst of huge prompts queues there instead of taking every thread,
    and the event loop keeps streaming meanwhile.
    """
    pool = request.app.get(PREP_POOL_KEY)
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


@dataclass
class Job:
    """One engine request: choice ``index`` of the reply, for prompt ``prompt_index``."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    group: str  # the reply's id: its choices share max_num_seqs fairly with other requests


@dataclass
class Choice:
    """What one choice has produced so far (for non-streamed replies and usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs or []
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


@dataclass
class Reply:
    """Identity of one API reply and the per-choice state."""

    id: str
    model: str
    jobs: list[Job]
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, Choice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.choices = {j.index: Choice() for j in self.jobs}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def adapter_for(
    engine: AsyncEngine, model: str | None, adapters: list[tuple[str, float]] | None = None
) -> AdapterChoice:
    """None for the base model, else the adapter name (the engine checks that it exists);
    a composition (``adapters``) runs on the base model's name only."""
    base = model is None or model == engine.model_name
    if adapters is not None:
        if not base:
            raise APIError(
                400,
                f"adapters (a composition) needs model set to the base model "
                f"{engine.model_name!r}, got {model!r}",
                param="model",
            )
        return adapters
    return None if base else model


def make_jobs(
    engine: AsyncEngine, req: GenerationRequest, prompts: list[list[int]], reply_id: str
) -> list[Job]:
    """Choices are indexed prompt-major: prompt p, sample i -> index p * n + i."""
    limit = context_limit(engine)
    jobs = []
    for p, ids in enumerate(prompts):
        if len(ids) >= engine.max_model_len:
            raise APIError(
                400,
                f"the prompt is {len(ids)} tokens, the maximum context length is "
                f"{engine.max_model_len}",
                param="prompt" if req.messages is None else "messages",
            )
        for i in range(req.n):
            try:
                params = req.params(len(ids), limit, i)
            except ValueError as e:
                raise from_exception(e) from None
            jobs.append(Job(p * req.n + i, p, ids, params, f"{reply_id}-{p}-{i}", reply_id))
    return jobs


def context_limit(engine: AsyncEngine) -> int:
    """Longest prompt + output one request may have: the context length, capped by the KV pool."""
    kv_tokens = engine.capacity_report().get("kv_tokens")
    return min(engine.max_model_len, kv_tokens or engine.max_model_len)


def usage(reply: Reply) -> dict[str, Any]:
    """OpenAI usage; the prompt counts once per prompt, not once per choice (as vLLM)."""
    firsts: dict[int, Job] = {}
    for j in reply.jobs:
        firsts.setdefault(j.prompt_index, j)
    prompt = sum(len(j.prompt_ids) for j in firsts.values())
    cached = sum(reply.choices[j.index].num_cached_tokens for j in firsts.values())
    completion = sum(c.num_output_tokens for c in reply.choices.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class FanOut:
    """``async with FanOut(engine, jobs, adapter) as fan: async for job, out in fan: ...``

    Yields outputs of all jobs in arrival order; the first engine error is raised. With a
    ``drain``, shutdown may abort the jobs (``shut_down`` then tells the consumer why).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        jobs: list[Job],
        adapter: AdapterChoice,
        drain: Drain | None = None,
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.adapter = adapter
        self.drain = drain
        self.shut_down = False
        self._queue: asyncio.Queue[tuple[Job, RequestOutput | None, BaseException | None]]
        self._queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def _pump(self, job: Job) -> None:
        try:
            if self.shut_down:  # aborted before this job reached the engine
                raise APIError(503, "the server is shutting down")
            async for out in self.engine.generate(
                job.prompt_ids, job.params, adapter=self.adapter, request_id=job.request_id,
                group=job.group,
            ):  # fmt: skip
                self._queue.put_nowait((job, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((job, None, e))
        self._queue.put_nowait((job, None, None))  # this job is done

    def abort_for_shutdown(self) -> None:
        self.shut_down = True
        for j in self.jobs:
            self.engine.abort(j.request_id)

    async def __aenter__(self) -> FanOut:
        if self.drain is not None:
            self.drain.check_open()
            self.drain.add(self)
        self._tasks = [asyncio.create_task(self._pump(j)) for j in self.jobs]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.drain is not None:
            self.drain.discard(self)
        for t in self._tasks:
            t.cancel()
        for j in self.jobs:
            self.engine.abort(j.request_id)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def __aiter__(self) -> FanOut:
        self._left = len(self.jobs)
        return self

    async def __anext__(self) -> tuple[Job, RequestOutput]:
        while self._left:
            job, out, err = await self._queue.get()
            if err is not None:
                raise err
            if out is None:
                self._left -= 1
                continue
            return job, out
        raise StopAsyncIteration
