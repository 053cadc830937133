"""``tool_choice: "required"`` ends with a complete ``tool_calls`` list: its grammar allows at
most ``MAX_REQUIRED_CALLS`` calls (one with ``parallel_tool_calls: false``) and then reaches its
end; an output cut at ``length`` keeps the calls that are complete and never turns raw call JSON
into ``content``, streamed or not. (The demo model, greedy, kept opening calls until
``length`` and its whole output landed in ``message.content`` with no ``tool_calls``.)"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from loraplex.engine.server.limits import ServerLimits
from loraplex.engine.server.tool_calls import MAX_REQUIRED_CALLS, ToolStream, parse_calls
from loraplex.engine.server.tools import parse_tools
from tests.structured.forms import BOUNDED, MESSAGES, PARAMS, TIME

TOOLS = [BOUNDED, TIME]


async def _both(server: Any, **kw: Any) -> tuple[Any, tuple[str, list[dict], str | None]]:
    """The non-streamed choice and the streamed one (content, calls merged by index, reason)."""
    c = server.client()
    body = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, **kw)
    full = await c.chat.completions.create(**body)
    stream = await c.chat.completions.create(**body, stream=True)
    calls: dict[int, dict] = {}
    content, reason = "", None
    async for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reason = ch.finish_reason or reason
    return full.choices[0], (content, [calls[i] for i in sorted(calls)], reason)


def _check_calls(calls: list[Any]) -> list[tuple[str, dict]]:
    got = [(t.function.name, json.loads(t.function.arguments)) for t in calls]
    for name, args in got:
        assert name in ("get_weather", "get_time")
        if name == "get_weather":
            jsonschema.validate(args, PARAMS)
    assert len({t.id for t in calls}) == len(calls)
    return got


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("model", ["demo", "pirate", "sql"])
async def test_required_ends_with_a_complete_list(demo_server, model):
    full, (content, calls, reason) = await _both(demo_server, model=model, max_tokens=460)
    assert full.finish_reason == "tool_calls", full
    assert full.message.content is None
    got = _check_calls(full.message.tool_calls)
    assert 1 <= len(got) <= MAX_REQUIRED_CALLS
    assert (content, reason) == ("", "tool_calls")
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == got


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("max_tokens", [3, 45, 100])
async def test_required_cut_at_length_keeps_the_complete_calls(demo_server, max_tokens):
    full, (content, calls, reason) = await _both(demo_server, model="sql", max_tokens=max_tokens)
    assert full.finish_reason == "length" and reason == "length"
    assert full.message.content is None and content == ""  # no raw call JSON as content
    got = _check_calls(full.message.tool_calls or [])
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == got
    if max_tokens >= 45:  # (a get_time call is ~32 demo tokens)
        assert got


def _tools(parallel: bool = True):
    body = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel}
    return parse_tools(body, ServerLimits())


def test_the_required_grammar_is_bounded():
    many = json.loads(_tools().constraint().value)
    assert many["minItems"] == 1 and many["maxItems"] == MAX_REQUIRED_CALLS
    one = json.loads(_tools(parallel=False).constraint().value)
    assert one["minItems"] == 1 and one["maxItems"] == 1


WHOLE = (
    '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": '
    '{"city": "a]}\\"{[", "unit": "C"}}, {"name": "get_time", "parameters": {}}]'
)
WANT = [("get_time", {}), ("get_weather", {"city": 'a]}"{[', "unit": "C"}), ("get_time", {})]


def _plain(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_required_output_parses_whole_cut_and_streamed_in_every_split():
    tools = _tools()
    assert parse_calls(WHOLE, tools, "hermes")[0] is None
    assert _plain(parse_calls(WHOLE, tools, "hermes")[1]) == WANT
    ends = [WHOLE.index("}}, ") + 2, WHOLE.index('"C"}}, ') + 5, len(WHOLE) - 1]
    for cut in range(len(WHOLE) + 1):
        text = WHOLE[:cut]
        complete = sum(cut >= e for e in ends)
        content, calls = parse_calls(text, tools, "hermes")
        assert content is None and _plain(calls) == WANT[:complete], text
        st = ToolStream(tools, "hermes")
        c1, k1 = st.feed(text)
        assert c1 == "" and _plain(k1) == WANT[:complete]  # each call as soon as it closes
        c2, k2 = st.feed(WHOLE[cut:])
        c3, k3 = st.finish()
        assert c2 == c3 == "" and _plain(k1 + k2 + k3) == WANT
        assert [c["index"] for c in k1 + k2 + k3] == [0, 1, 2]
