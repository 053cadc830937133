"""Error replies: vLLM's shape ``{"error": {message, type, param, code}}`` and status codes."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.helpers.server import BASE


async def _post(server, path: str, data: bytes | dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        kw = {"json": data} if isinstance(data, dict) else {"data": data}
        async with s.post(f"{server.url}{path}", **kw) as r:
            return r.status, await r.json()


def _assert_shape(body: dict, code: int, type_: str, param: str | None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["type"], err["param"]) == (code, type_, param), err
    assert err["message"]


async def test_unknown_model_is_404(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        await client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    status, body = await _post(server, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404
    _assert_shape(body, 404, "NotFoundError", "model")
    assert "nope" in body["error"]["message"]


@pytest.mark.parametrize(
    "path, data, param",
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/chat/completions", b"[1, 2]", None),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
        ("/v1/completions", {"model": BASE, "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": BASE, "prompt": [999_999]}, "prompt"),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "echo": True}, "echo"),
        (
            "/v1/completions",
            {"model": BASE, "prompt": "hi", "stream_options": {}},
            "stream_options",
        ),
        ("/v1/completions", {"model": BASE, "prompt": "hi", "stop": [""]}, "stop"),
        ("/v1/chat/completions", {"model": BASE, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": BASE, "messages": [{"content": "x"}]}, "messages[0]"),
        (
            "/v1/chat/completions",
            {"model": BASE, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": BASE, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
    ],
)
async def test_bad_requests_are_400(server, path, data, param):
    status, body = await _post(server, path, data)
    assert status == 400, body
    _assert_shape(body, 400, "BadRequestError", param)


async def test_openai_client_sees_bad_request(server):
    with pytest.raises(openai.BadRequestError):
        await server.client().completions.create(model=BASE, prompt="hi", top_p=0)


async def test_unknown_route_uses_error_shape(server):
    async with aiohttp.ClientSession() as s, s.get(f"{server.url}/v1/nothing") as r:
        assert r.status == 404
        _assert_shape(await r.json(), 404, "NotFoundError", None)
    # the server keeps serving after errors
    r = await server.client().completions.create(model=BASE, prompt=[4, 5], max_tokens=2)
    assert r.usage.completion_tokens <= 2
