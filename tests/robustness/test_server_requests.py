"""Hostile request bodies: every one is a 4xx in the error shape naming its limit, never a 500,
and the server serves the same greedy completion afterwards (issue 12, items 2 and 4)."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
import pytest_asyncio

from loraplex.engine.server.limits import ServerLimits
from tests.robustness.server_fixtures import (
    BASE,
    assert_error,
    greedy_text,
    serve_demo,
    wait_idle,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMITS = ServerLimits(
    max_request_body_bytes=64 << 10,
    max_prompt_chars=2000,
    max_prompts_times_n=16,
    max_stop_strings=4,
    max_stop_string_chars=8,
    max_json_depth=8,
)
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = {"role": "user", "content": "hi"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    async for s in serve_demo(LIMITS):
        s.reference = await greedy_text(s)  # type: ignore[attr-defined]
        yield s


async def _still_serves(server) -> None:
    await wait_idle(server.engine)
    assert await greedy_text(server) == server.reference


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (path, body, status, param, words in the message)
LIMIT_CASES = [
    (CMPL, {"model": BASE, "prompt": "x" * 70_000}, 413, None, "--max-request-body-bytes"),
    (CMPL, {"model": BASE, "prompt": "a" * 2001, "max_tokens": 1}, 400, "prompt", "--max-prompt-chars"),
    (CMPL, {"model": BASE, "prompt": ["a" * 1000] * 3}, 400, "prompt", "--max-prompt-chars"),
    (CHAT, {"model": BASE, "messages": [{"role": "user", "content": "a" * 2001}]}, 400, "messages", "--max-prompt-chars"),
    (CMPL, {"model": BASE, "prompt": [[5, 6, 7]] * 400, "n": 128}, 400, "prompt", "--max-prompts-times-n"),
    (CMPL, {"model": BASE, "prompt": [5, 6, 7], "n": 17}, 400, "n", "--max-prompts-times-n"),
    (CHAT, {"model": BASE, "messages": [USER], "n": 17}, 400, "n", "--max-prompts-times-n"),
    (CMPL, {"model": BASE, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "--max-stop-strings"),
    (CMPL, {"model": BASE, "prompt": "hi", "stop": "abcdefghi"}, 400, "stop", "--max-stop-string-chars"),
    (CMPL, {"model": BASE, "prompt": "hi", "stop_token_ids": [1, 2, 3, 4, 5]}, 400, "stop_token_ids", "--max-stop-strings"),
    (CHAT, {"model": BASE, "messages": [{**USER, "x": json.loads(_nested(9))}]}, 400, "messages", "--max-json-depth"),
    (CHAT, {"model": BASE, "messages": [USER], "chat_template_kwargs": {"t": json.loads(_nested(9))}}, 400, "chat_template_kwargs", "--max-json-depth"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, status, param, says", LIMIT_CASES)
async def test_limits_refuse_with_the_flag_named(server, path, body, status, param, says):
    code, reply = await server.post(path, body)
    assert code == status, reply
    assert_error(reply, status, param=param, says=says)


async def test_limits_allow_what_fits(server):
    ok = [
        (CMPL, {"model": BASE, "prompt": "a" * 1000, "max_tokens": 2}),
        (CMPL, {"model": BASE, "prompt": [[5, 6, 7]] * 4, "n": 4, "max_tokens": 2}),
        (CMPL, {"model": BASE, "prompt": "hi", "stop": ["a", "b", "c", "abcdefgh"], "max_tokens": 2}),
        (CHAT, {"model": BASE, "messages": [{**USER, "x": json.loads(_nested(6))}], "max_tokens": 2}),
    ]  # fmt: skip
    for path, body in ok:
        code, reply = await server.post(path, body)
        assert code == 200, (body, reply)
    await _still_serves(server)


SURROGATE_CASES = [
    (CMPL, {"model": BASE, "prompt": "\ud800"}, "prompt"),
    (CMPL, {"model": BASE, "prompt": ["ok", "a\udfffb"]}, "prompt"),
    (CMPL, {"model": BASE, "prompt": "hi", "stop": ["\ud800"]}, "stop"),
    (CMPL, {"model": "\ud800", "prompt": "hi"}, "model"),
    (CHAT, {"model": BASE, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (CHAT, {"model": BASE, "messages": [{"role": "\udc00", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"model": BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud801"}]}]}, "messages[0].content[0].text"),
    (CHAT, {"model": BASE, "messages": [USER], "chat_template_kwargs": {"k": "\ud800"}}, "chat_template_kwargs.k"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, param", SURROGATE_CASES)
async def test_lone_surrogates_are_400(server, path, body, param):
    # json.dumps escapes the lone surrogate as \ud800, exactly what a hostile client sends
    code, reply = await server.post(path, json.dumps(body).encode())
    assert code == 400, reply
    assert_error(reply, 400, param=param, says="surrogate")


@pytest.mark.parametrize("key", ["messages", "self", "add_generation_prompt"])
async def test_chat_template_kwargs_cannot_bind_reserved_names(server, key):
    body = {"model": BASE, "messages": [USER], "chat_template_kwargs": {key: [USER]}}
    code, reply = await server.post(CHAT, body)
    assert code == 400, reply
    assert_error(reply, 400, param="chat_template_kwargs", says=key)


@pytest.mark.parametrize("path", [CMPL, CHAT, "/v1/load_lora_adapter"])
async def test_json_nested_thousands_deep_is_400(server, path):
    raw = ('{"model": "demo", "prompt": ' + _nested(5000) + "}").encode()
    headers = {"Authorization": "Bearer s3cret-admin", "Content-Type": "application/json"}
    code, reply = await server.post(path, raw, headers)
    assert code == 400, reply
    assert_error(reply, 400, says="nested")


def _deflate(data: bytes) -> bytes:
    return zlib.compress(data)


async def test_content_encodings(server):
    body = json.dumps({"model": BASE, "prompt": "The quick brown fox", "max_tokens": 8,
                       "temperature": 0}).encode()  # fmt: skip
    for enc, data in (("gzip", gzip.compress(body)), ("deflate", _deflate(body))):
        code, reply = await server.post(CMPL, data, {"Content-Encoding": enc})
        assert code == 200, (enc, reply)
        assert reply["choices"][0]["text"] == server.reference
    bad = [
        ("gzip", body, 400, "gzip"),  # says gzip, is not
        ("gzip", gzip.compress(body)[:-12], 400, "gzip"),  # truncated
        ("deflate", b"\x00\x01garbage", 400, "deflate"),
        ("br", body, 415, "br"),
        ("zstd", body, 415, "zstd"),
        ("gzip", gzip.compress(b" " * (1 << 20)), 413, "--max-request-body-bytes"),  # bomb
    ]
    for enc, data, status, says in bad:
        code, reply = await server.post(CMPL, data, {"Content-Encoding": enc})
        assert code == status, (enc, reply)
        assert_error(reply, status, says=says)
    await _still_serves(server)


async def test_chunked_body_over_the_limit_is_413(server):
    async def chunks():
        for _ in range(20):
            yield b" " * 8192  # no Content-Length: the limit counts while reading

    code, reply = await server.post(CMPL, chunks())  # type: ignore[arg-type]
    assert code == 413, reply
    assert_error(reply, 413, says="--max-request-body-bytes")
