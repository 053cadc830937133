"""Tool calls parsed from the model's own format (Hermes tags, Llama 3 JSON), whole and
streamed in every split; ``tools`` / ``tool_choice`` validation; prompts with tools."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from loraplex.engine.demo import demo_model_dir
from loraplex.engine.server.chat import render_chat
from loraplex.engine.server.errors import APIError
from loraplex.engine.server.limits import ServerLimits
from loraplex.engine.server.protocol import parse_chat
from loraplex.engine.server.tool_calls import MAX_REQUIRED_CALLS
from loraplex.engine.server.tools import ToolStream, parse_calls, parse_tools, tool_format
from loraplex.engine.tokenizer import Tokenizer
from tests.structured.forms import TIME_ANY, WEATHER

LIMITS = ServerLimits()


def tools(choice="auto"):
    return parse_tools({"tools": [WEATHER, TIME_ANY], "tool_choice": choice}, LIMITS)


def streamed(text: str, t, fmt: str, cuts: list[int]):
    st = ToolStream(t, fmt)
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for p in pieces:
        c, k = st.feed(p)
        content, calls = content + c, calls + k
    c, k = st.finish()
    return content + c, calls + k


def _plain(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
WANT = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]


def test_hermes_whole_and_in_every_split():
    content, calls = parse_calls(HERMES, tools(), "hermes")
    assert content == "Let me check." and _plain(calls) == WANT
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for cut in range(1, len(HERMES)):
        for cut2 in (cut + 3, cut + 11):
            cuts = [cut] + ([cut2] if cut2 < len(HERMES) else [])
            content, calls = streamed(HERMES, tools(), "hermes", cuts)
            assert content.strip() == "Let me check.", cuts
            assert _plain(calls) == WANT and [c["index"] for c in calls] == [0, 1]


def test_text_that_only_looks_like_a_call_stays_text():
    for text in ("a <tool_ b", "x <tool_call>not json</tool_call> y", "plain answer"):
        content, calls = parse_calls(text, tools(), "hermes")
        assert calls == [] and content == text
        assert streamed(text, tools(), "hermes", [2, 5]) == (text, [])
    # an unclosed last block that parses still counts
    _, calls = parse_calls('<tool_call>{"name": "get_time", "arguments": {}}', tools(), "hermes")
    assert _plain(calls) == [("get_time", {})]


LLAMA = '{"name": "get_weather", "parameters": {"city": "Rome"}}'


def test_llama3_json_calls():
    assert _plain(parse_calls(LLAMA, tools(), "llama3")[1]) == [("get_weather", {"city": "Rome"})]
    two = f'<|python_tag|>{LLAMA}; {{"name": "get_time", "parameters": {{}}}}'
    assert [n for n, _ in _plain(parse_calls(two, tools(), "llama3")[1])] == [
        "get_weather",
        "get_time",
    ]
    assert parse_calls("It is sunny.", tools(), "llama3") == ("It is sunny.", [])
    for cut in range(1, len(LLAMA)):
        content, calls = streamed(LLAMA, tools(), "llama3", [cut])
        assert content == "" and _plain(calls) == [("get_weather", {"city": "Rome"})]
    assert streamed("Sunny, 20 C.", tools(), "llama3", [3]) == ("Sunny, 20 C.", [])


def test_required_and_named_outputs():
    req = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert [n for n, _ in _plain(parse_calls(req, tools("required"), "hermes")[1])] == [
        "get_time",
        "get_weather",
    ]
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse_calls('{"city": "Oslo"}', named, "hermes")
    assert content is None and _plain(calls) == [("get_weather", {"city": "Oslo"})]
    content, calls = streamed('{"city": "Oslo"}', named, "hermes", [3, 9])
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert {c["index"] for c in calls} == {0}


def test_forced_choices_are_grammars():
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint().value) == WEATHER["function"]["parameters"]
    required = json.loads(tools("required").constraint().value)
    assert required["type"] == "array" and required["minItems"] == 1
    assert len(required["items"]["anyOf"]) == 2 and required["maxItems"] == MAX_REQUIRED_CALLS
    one = parse_tools(
        {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}, LIMITS
    )
    assert json.loads(one.constraint().value)["maxItems"] == 1
    assert tools("auto").constraint() is None
    assert tools("none") is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body})
    assert e.value.status == 400 and e.value.param == param


MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'ipython' %}{{ m['content'] }}{% endif %}"
    "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0].function.arguments | tojson }}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def _render(template: str | None, body: dict) -> str:
    tok = Tokenizer.from_dir(demo_model_dir(), chat_template=template)
    req = parse_chat({"messages": MESSAGES, **body})
    return tok.decode(render_chat(SimpleNamespace(tokenizer=tok), req), skip_special_tokens=False)


def test_a_template_without_tools_gets_them_in_hermes_form():
    text = _render(None, {"tools": [WEATHER]})
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text  # the history
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert "<tools>" not in _render(None, {"tools": [WEATHER], "tool_choice": "none"})


def test_a_template_with_tools_renders_them_itself():
    assert tool_format(LLAMA_TEMPLATE) == "llama3" and tool_format(None) == "hermes"
    text = _render(LLAMA_TEMPLATE, {"tools": [WEATHER]})
    assert "<tools>" not in text and '"name": "get_weather"' in text
    assert '<|python_tag|>{"city": "Paris"}' in text  # arguments given to the template as an object
