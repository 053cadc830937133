"""Hostile or malformed request fields on the demo model's HTTP server: each is a 400 that names
the offending field (``param``), never a 500, and the server serves on after it."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.demo import register_demo_adapters
from loraplex.engine.server import create_app, start_server
from tests.helpers.server import Server

pytestmark = pytest.mark.asyncio(loop_scope="module")
USER = [{"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def demo_server():
    async with AsyncEngine(EngineConfig(device="cpu")) as engine:
        await register_demo_adapters(engine)
        runner, port = await start_server(create_app(engine))
        try:
            yield Server(f"http://127.0.0.1:{port}", engine)
        finally:
            await runner.cleanup()


async def post(server: Any, body: dict[str, Any] | str) -> tuple[int, dict[str, Any]]:
    """Status and JSON reply of a chat request (``body`` as text: sent as it is)."""
    data = body if isinstance(body, str) else json.dumps({"max_tokens": 4, **body})
    url = f"{server.url}/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, await r.json()


async def refused(server: Any, body: dict[str, Any] | str, param: str) -> str:
    """The message of the 400 that ``body`` must get, naming ``param``."""
    status, reply = await post(server, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    return reply["error"]["message"]


async def served(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    status, reply = await post(server, body)
    assert status == 200, reply
    return reply


def nested_schema(levels: int) -> str:
    """A schema as JSON text: arrays of arrays ``levels`` deep (valid at any depth)."""
    text = "{}"
    for _ in range(levels):
        text = '{"type": "array", "items": ' + text + "}"
    return text


@pytest.mark.parametrize("levels", [40, 200, 600, 5000])
async def test_a_schema_as_deep_json_text_is_refused_naming_the_field(demo_server, levels):
    """Text schemas get the depth bound of object ones (``--max-json-depth``, 32 here); past
    Python's recursion limit (~1000) json.loads raised RecursionError (a 500)."""
    text = nested_schema(levels)
    says = await refused(demo_server, {"messages": USER, "guided_json": text}, "guided_json")
    assert "--max-json-depth" in says
    rf = {"type": "json_schema", "json_schema": {"name": "deep", "schema": text}}
    await refused(demo_server, {"messages": USER, "response_format": rf}, "response_format")
    await served(demo_server, {"messages": USER, "guided_json": nested_schema(3)})


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    ("choice", "param"),
    [
        ({"type": "function", "function": "get_weather"}, "tool_choice.function"),
        ({"type": "function", "function": {"name": ["get_weather"]}}, "tool_choice.function.name"),
        ({"type": "function"}, "tool_choice.function"),
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ({"type": "retrieval"}, "tool_choice"),
    ],
)
async def test_a_malformed_tool_choice_is_refused_naming_the_field(demo_server, choice, param):
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": choice}
    await refused(demo_server, body, param)


def _fn(**kw: Any) -> dict[str, Any]:
    return {"type": "function", "function": {**WEATHER["function"], **kw}}


def _history(call: Any) -> list[dict[str, Any]]:
    """A chat whose assistant turn holds ``call`` in tool_calls, answered by a tool turn."""
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    return [*USER, turn, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [_fn(description="\ud800")]}, "tools[0].function.description"),
        ({"tools": [WEATHER, _fn(name="f", description="x\udfff")]}, "tools[1].function.description"),
        ({"tools": [{"type": "function", "function": "get_weather"}]}, "tools[0].function"),
        ({"messages": _history({**CALL, "function": "get_weather"})}, "messages[1].tool_calls[0].function"),
        ({"messages": _history({**CALL, "function": {"name": "f\ud800", "arguments": "{}"}})}, "messages[1].tool_calls[0].function.name"),
        ({"tools": [WEATHER], "messages": _history({**CALL, "function": "get_weather"})}, "messages[1].tool_calls[0].function"),
        ({"messages": _history({**CALL, "function": {"arguments": "{}"}})}, "messages[1].tool_calls[0].function.name"),
        ({"messages": _history("get_weather")}, "messages[1].tool_calls[0]"),
    ],
)  # fmt: skip
async def test_broken_tools_and_tool_calls_are_refused_naming_the_field(demo_server, body, param):
    await refused(demo_server, {"messages": USER, **body}, param)
    await served(demo_server, {"messages": _history(CALL), "tools": [WEATHER]})


HUGE_INT = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "adapters": [{"name": "sql", "weight": 1' + "0" * 400 + "}]}"  # fmt: skip


@pytest.mark.parametrize(
    "weight", ["HUGE_INT", 1e20, 1e308, -1e5, 100.5, float("nan"), float("inf")]
)
async def test_a_composition_weight_out_of_bounds_is_refused(demo_server, weight):
    """|weight| <= 100 (MAX_COMPOSITION_WEIGHT): 10**400 overflowed float() (a 500), and huge
    finite weights were 500s naming the adapter file's weighted tensor."""
    await served(demo_server, {"messages": USER, "model": "sql"})  # fetched: it may compose
    if weight == "HUGE_INT":
        body: dict[str, Any] | str = HUGE_INT
    else:  # (json.dumps writes NaN / Infinity, which Python's parser reads back)
        body = {"messages": USER, "adapters": [{"name": "sql", "weight": weight}]}
    says = await refused(demo_server, body, "adapters[0].weight")
    assert "100" in says
    parts = [{"name": "sql", "weight": -2.5}, {"name": "pirate", "weight": 100}]
    await served(demo_server, {"messages": USER, "model": "pirate"})
    await served(demo_server, {"messages": USER, "adapters": parts})


async def test_boolean_schemas(demo_server):
    """``true`` is the schema of any JSON value, ``false`` accepts none (a 400 naming the field
    rather than llguidance's "Expecting object schema" with no param)."""
    for form in ({"guided_json": True}, {"guided_json": "true"}):
        reply = await served(
            demo_server, {"messages": USER, "max_tokens": 60, "temperature": 0, **form}
        )
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        json.loads(choice["message"]["content"])
    rf = {"type": "json_schema", "json_schema": {"name": "any", "schema": True}}
    await served(demo_server, {"messages": USER, "response_format": rf})
    says = await refused(demo_server, {"messages": USER, "guided_json": False}, "guided_json")
    assert "accepts no value" in says
    await refused(demo_server, {"messages": USER, "guided_json": "false"}, "guided_json")
    rf = {"type": "json_schema", "json_schema": {"name": "none", "schema": False}}
    await refused(demo_server, {"messages": USER, "response_format": rf}, "response_format")


@pytest.mark.parametrize(
    ("so", "param"),
    [
        ({"json": 0}, "structured_outputs.json"),
        ({"json": False}, "structured_outputs.json"),
        ({"json": [{"type": "string"}]}, "structured_outputs.json"),
        ({"json": nested_schema(40)}, "structured_outputs.json"),
        ({"jsn": {"type": "string"}}, "structured_outputs.jsn"),
        ({"regex": 5}, "structured_outputs.regex"),
        ({"choice": "yes"}, "structured_outputs.choice"),
        ({"grammar": ["start: 'a'"]}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"json_object": True, "disable_fallback": "no"}, "structured_outputs.disable_fallback"),
        ({"json": {"not": {"type": "string"}}}, "structured_outputs.json"),  # (compile error)
    ],
)
async def test_structured_outputs_keys_and_types_are_checked(demo_server, so, param):
    """Unknown keys and wrong-typed values were ignored silently (``{"json": 0}``: no
    constraint at all)."""
    await refused(demo_server, {"messages": USER, "structured_outputs": so}, param)
    for fine in ({"json_object": False}, {"choice": ["yes"], "disable_fallback": True}):
        await served(demo_server, {"messages": USER, "structured_outputs": fine})


PARAMS = "tools[0].function.parameters"


@pytest.mark.parametrize(
    ("fn", "param", "says"),
    [
        ({"parameters": {"type": 5}}, PARAMS, "parameters.type must be one of"),
        ({"parameters": []}, PARAMS, "JSON schema object"),
        ({"parameters": {"type": "string"}}, PARAMS, "type 'object'"),
        ({"parameters": {"type": "object", "properties": []}}, PARAMS, "properties must be"),
        ({"parameters": {"properties": {"city": {"type": "strin"}}}}, PARAMS, "properties.city.type"),
        ({"parameters": {"properties": {"city": 3}}}, PARAMS, "properties.city must be a schema"),
        ({"parameters": {"type": "object", "required": "city"}}, PARAMS, "required must be"),
        ({"parameters": {"properties": {"a": {"anyOf": []}}}}, PARAMS, "anyOf must be"),
        ({"parameters": {"properties": {"a": {"maxLength": -1}}}}, PARAMS, "maxLength"),
        ({"parameters": {"properties": {"a b": {"items": [{"type": 1}]}}}}, PARAMS, "['a b'].items[0].type"),
        ({"name": ""}, "tools[0].function.name", "must match"),
        ({"name": 5}, "tools[0].function.name", "must match"),
        ({"name": "get weather"}, "tools[0].function.name", "must match"),
        ({"name": None}, "tools[0].function.name", "must match"),
    ],
)  # fmt: skip
async def test_a_malformed_tool_is_refused_under_auto(demo_server, fn, param, says):
    """Under tool_choice "auto" (the default) nothing compiles the tools' schemas: a malformed
    one went to the model as it was."""
    message = await refused(demo_server, {"messages": USER, "tools": [_fn(**fn)]}, param)
    assert says in message
    fine = {
        "type": "object",
        "properties": {"a": {"type": ["string", "null"], "enum": ["x", None]}},
    }
    await served(demo_server, {"messages": USER, "tools": [_fn(parameters=fine)]})


def _tool_turn(**kw: Any) -> dict[str, Any]:
    return {"role": "tool", "content": "18 C", **kw}


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([*USER, _tool_turn(tool_call_id="nope")], "messages[1].tool_call_id"),
        ([*USER, _tool_turn()], "messages[1].tool_call_id"),
        ([*_history(CALL), _tool_turn(tool_call_id="call_2")], "messages[3].tool_call_id"),
        ([*_history(CALL), _tool_turn(tool_call_id=["call_1"])], "messages[3].tool_call_id"),
        (_history({k: v for k, v in CALL.items() if k != "id"}), "messages[1].tool_calls[0].id"),
        ([*USER, _tool_turn(tool_call_id="call_1"), *_history(CALL)[1:]], "messages[1].tool_call_id"),
    ],
)  # fmt: skip
async def test_a_tool_turn_must_answer_an_earlier_call(demo_server, messages, param):
    """As OpenAI: a tool message answers a call of an earlier assistant turn, by its id."""
    await refused(demo_server, {"messages": messages}, param)
