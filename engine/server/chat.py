"""``POST /v1/chat/completions``: messages rendered with the model's chat template."""

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
from loraplex.engine.server.logprobs import TokenNamer, chat_logprobs
from loraplex.engine.server.protocol import GenerationRequest, parse_chat
from loraplex.engine.server.respond import respond
from loraplex.engine.server.state import DRAIN_KEY, ENGINE_KEY, LIMITS_KEY
from loraplex.engine.server.tools import ToolStream, parse_calls, tool_format, tool_messages
from loraplex.engine.tokenizer import TokenizerError

__all__ = ["create_chat_completion", "render_chat"]


def render_chat(engine: AsyncEngine, req: GenerationRequest, adapter: Any = None) -> list[int]:
    """Prompt token ids of the chat (the template's text already holds BOS), with the
    tokenizer of requests on ``adapter`` (an adapter that added tokens has its own).

    Blocking: call it through ``off_loop``.
    """
    tok = engine.tokenizer if adapter is None else engine.tokenizer_for(adapter)
    if tok is None:
        raise APIError(400, "this model has no tokenizer, so it cannot chat", param="messages")
    assert req.messages is not None
    messages, extra = req.messages, {}
    if req.tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages, extra = tool_messages(messages, req.tools, tok.chat_template)
    try:
        text = tok.apply_chat_template(messages, **req.chat_kwargs, **extra)
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages") from e
    ids = tok.encode_batch([text], add_special_tokens=False)[0]
    if not ids:
        raise APIError(400, "the rendered chat prompt is empty", param="messages")
    return ids


class ChatShape:
    chunk_object = "chat.completion.chunk"

    def __init__(self, engine: AsyncEngine, req: GenerationRequest, adapter: Any = None) -> None:
        self.req = req
        tok = engine.tokenizer if adapter is None else engine.tokenizer_for(adapter)
        self.namer = TokenNamer(tok, req.tokens_as_ids)
        self.tools = req.tools
        self.fmt = tool_format(tok.chat_template) if req.tools else "hermes"
        self.streams: dict[int, ToolStream] = {}  # per choice, with tools

    def _reason(self, reason: str | None, calls: int) -> str | None:
        """OpenAI: "tool_calls" when the model chose to call (a forced named call: "stop")."""
        named = self.tools is not None and self.tools.choice == "named"
        return "tool_calls" if reason == "stop" and calls and not named else reason

    def _tool_delta(self, job: Job, out: RequestOutput) -> tuple[dict[str, Any], str | None]:
        assert self.tools is not None
        st = self.streams.setdefault(job.index, ToolStream(self.tools, self.fmt))
        content, calls = st.feed(out.text)
        if out.finished:
            more, rest = st.finish()
            content, calls = content + more, calls + rest
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, self._reason(out.finish_reason, st.count) if out.finished else None

    def _logprobs(self, lps: list[Any]) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        return chat_logprobs(self.namer, self.req.logprobs, lps)

    def opening(self, reply: Reply) -> list[dict[str, Any]]:
        chunks = []
        for job in reply.jobs:
            choice = {
                "index": job.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            chunks.append(
                {
                    "id": reply.id,
                    "object": self.chunk_object,
                    "created": reply.created,
                    "model": reply.model,
                    "choices": [choice],
                }
            )
        return chunks

    def delta(self, job: Job, out: RequestOutput) -> dict[str, Any] | None:
        if not (out.text or out.token_ids or out.finished):
            return None
        delta, reason = {"content": out.text} if out.text else {}, out.finish_reason
        if self.tools is not None:
            delta, reason = self._tool_delta(job, out)
        choice: dict[str, Any] = {
            "index": job.index,
            "delta": delta,
            "logprobs": self._logprobs(out.logprobs or []),
            "finish_reason": reason if out.finished else None,
            "stop_reason": out.stop_reason if out.finished else None,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = out.token_ids
        return choice

    def body(self, reply: Reply) -> dict[str, Any]:
        choices = []
        for job in reply.jobs:
            c = reply.choices[job.index]
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            reason = c.finish_reason
            if self.tools is not None:
                content, calls = parse_calls(c.text, self.tools, self.fmt)
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = self._reason(reason, len(calls))
            choice: dict[str, Any] = {
                "index": job.index,
                "message": message,
                "logprobs": self._logprobs(c.logprobs),
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
            if self.req.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = job.prompt_ids
            choices.append(choice)
        return {
            "id": reply.id,
            "object": "chat.completion",
            "created": reply.created,
            "model": reply.model,
            "choices": choices,
            "usage": usage(reply),
        }


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    request.app[DRAIN_KEY].check_open()
    limits = request.app[LIMITS_KEY].for_context(engine.max_model_len)
    req = await read_request(request, lambda body: parse_chat(body, limits))
    adapter = adapter_for(engine, req.model, req.adapters)
    await engine.load_before_tokenizing(adapter)  # its own tokenizer, if it adds tokens
    reply_id = new_id("chatcmpl")
    request[REQUEST_ID_KEY] = reply_id  # (a 500's log line and reply name it)
    prompt = await off_loop(request, render_chat, engine, req, adapter)
    jobs = make_jobs(engine, req, [prompt], reply_id)
    reply = Reply(reply_id, req.model or engine.model_name, jobs)
    return await respond(request, engine, req, reply, ChatShape(engine, req, adapter), adapter)
