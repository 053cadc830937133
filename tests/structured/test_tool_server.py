"""Tool calls through the HTTP server with the official openai client (demo model), streamed
and not: a named function and ``required`` are grammar-constrained; ``auto`` parses the
model's Hermes blocks (here made certain by a regex constraint on the output)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.structured.forms import BOUNDED, MESSAGES, PARAMS, TIME

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _both(c, **kw):
    """The non-streamed message and the streamed one (deltas merged as the client docs say)."""
    r = await c.chat.completions.create(messages=MESSAGES, temperature=0, max_tokens=80, **kw)
    stream = await c.chat.completions.create(
        messages=MESSAGES, temperature=0, max_tokens=80, stream=True, **kw
    )
    calls: dict[int, dict] = {}
    content, reason = "", None
    async for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            reason = ch.finish_reason or reason
    return r.choices[0], (content, [calls[i] for i in sorted(calls)], reason)


async def test_named_function_is_constrained(demo_server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    c = demo_server.client()
    full, (content, calls, reason) = await _both(
        c, model="sql", tools=[BOUNDED, TIME], tool_choice=choice
    )
    msg = full.message
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    assert full.finish_reason == "stop"  # (OpenAI: a forced call ends with "stop")
    assert content == "" and len(calls) == 1 and calls[0]["id"]
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments and reason == "stop"


async def test_required_calls_known_tools(demo_server):
    c = demo_server.client()
    full, (_, calls, reason) = await _both(
        c, model="pirate", tools=[BOUNDED, TIME], tool_choice="required", parallel_tool_calls=False
    )
    assert full.finish_reason == "tool_calls" and reason == "tool_calls"
    got = [(t.function.name, json.loads(t.function.arguments)) for t in full.message.tool_calls]
    assert len(got) == 1 and all(n in ("get_weather", "get_time") for n, _ in got)
    for n, args in got:
        if n == "get_weather":
            jsonschema.validate(args, PARAMS)
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == got


HERMES_CALL = (
    r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Lyon)", "unit": "C"\}\}\n</tool_call>'
)


async def test_auto_parses_the_models_hermes_blocks(demo_server):
    c = demo_server.client()
    full, (content, calls, reason) = await _both(
        c, model="demo", tools=[BOUNDED, TIME], extra_body={"guided_regex": HERMES_CALL}
    )
    assert full.message.content == "Sure." and full.finish_reason == "tool_calls"
    [call] = full.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] == "C"
    assert content == "Sure." and reason == "tool_calls"
    assert [(x["name"], x["arguments"]) for x in calls] == [
        ("get_weather", call.function.arguments)
    ]


async def test_auto_without_a_call_is_plain_content(demo_server):
    c = demo_server.client()
    full, (content, calls, reason) = await _both(
        c, model="demo", tools=[TIME], extra_body={"guided_choice": ["It is noon."]}
    )
    assert full.message.content == "It is noon." and not full.message.tool_calls
    assert full.finish_reason == "stop" and (content, calls, reason) == ("It is noon.", [], "stop")
