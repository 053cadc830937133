"""``POST /v1/completions``: text or token-id prompts, one choice per prompt × n."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.request import RequestOutput
from loraplex.engine.server.body import read_request
from loraplex.engine.server.errors import REQUEST_ID_KEY, APIError
from loraplex.engine.server.generation import (
    Job,
    Reply,
    adapter_for,
    make_jobs,
    new_id,
    off_loop,
    usage,
)
from loraplex.engine.server.logprobs import CompletionLogprobs, TokenNamer
from loraplex.engine.server.protocol import GenerationRequest, parse_completion
from loraplex.engine.server.respond import respond
from loraplex.engine.server.state import DRAIN_KEY, ENGINE_KEY, LIMITS_KEY

__all__ = ["create_completion", "encode_prompts"]


def encode_prompts(
    engine: AsyncEngine, prompts: list[str | list[int]], adapter: Any = None
) -> list[list[int]]:
    """Token ids of every prompt (text is encoded with the model's special tokens), with the
    tokenizer of requests on ``adapter`` (an adapter that added tokens has its own).

    Blocking: call it through ``off_loop``.
    """
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return list(prompts)  # type: ignore[arg-type]
    tokenizer = engine.tokenizer if adapter is None else engine.tokenizer_for(adapter)
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
    encoded = iter(tokenizer.encode_batch(texts))
    out = [next(encoded) if isinstance(p, str) else p for p in prompts]
    if any(not ids for ids in out):
        raise APIError(400, "the prompt is empty", param="prompt")
    return out


class CompletionShape:
    chunk_object = "text_completion"

    def __init__(
        self, engine: AsyncEngine, req: GenerationRequest, reply: Reply, adapter: Any = None
    ) -> None:
        self.req = req
        self.reply = reply
        namer = TokenNamer(
            (engine.tokenizer if adapter is None else engine.tokenizer_for(adapter)),
            req.tokens_as_ids,
        )
        k = req.logprobs
        self.logprobs = (
            {j.index: CompletionLogprobs(namer, k) for j in reply.jobs} if k is not None else None
        )

    def _choice(self, job: Job, text: str, token_ids: list[int], lps: list[Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": job.index,
            "text": text,
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
        if self.logprobs is not None:
            choice["logprobs"] = self.logprobs[job.index].chunk(lps)
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def opening(self, reply: Reply) -> list[dict[str, Any]]:
        return []

    def delta(self, job: Job, out: RequestOutput) -> dict[str, Any] | None:
        if not (out.text or out.token_ids or out.finished):
            return None
        choice = self._choice(job, out.text, out.token_ids, out.logprobs or [])
        if out.finished:
            choice["finish_reason"], choice["stop_reason"] = out.finish_reason, out.stop_reason
            if self.req.return_token_ids:
                choice["prompt_token_ids"] = job.prompt_ids
        return choice

    def body(self, reply: Reply) -> dict[str, Any]:
        choices = []
        for job in reply.jobs:
            c = reply.choices[job.index]
            choice = self._choice(job, c.text, c.token_ids, c.logprobs)
            choice["finish_reason"], choice["stop_reason"] = c.finish_reason, c.stop_reason
            if self.req.return_token_ids:
                choice["prompt_token_ids"] = job.prompt_ids
            choices.append(choice)
        return {
            "id": reply.id,
            "object": "text_completion",
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
            "usage": usage(reply),
        }


async def create_completion(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    request.app[DRAIN_KEY].check_open()
    limits = request.app[LIMITS_KEY].for_context(engine.max_model_len)
    req = await read_request(request, lambda body: parse_completion(body, limits))
    adapter = adapter_for(engine, req.model, req.adapters)
    await engine.load_before_tokenizing(adapter)  # its own tokenizer, if it adds tokens
    reply_id = new_id("cmpl")
    request[REQUEST_ID_KEY] = reply_id  # (a 500's log line and reply name it)
    prompts = await off_loop(request, encode_prompts, engine, req.prompts, adapter)
    jobs = make_jobs(engine, req, prompts, reply_id)
    reply = Reply(reply_id, req.model or engine.model_name, jobs)
    return await respond(
        request, engine, req, reply, CompletionShape(engine, req, reply, adapter), adapter
    )
