"""Structured output through the HTTP server with the official openai client (demo model):
``response_format``, ``structured_outputs`` and the ``guided_*`` aliases, streamed and not;
bad constraints are 400s naming the field while other requests go on."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.structured.forms import CHOICES, ENUM, NESTED, REGEX, check

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.asyncio(loop_scope="module")
MESSAGES = [{"role": "user", "content": "Describe a product."}]


async def test_response_format_json_schema_chat_stream_and_not(demo_server):
    c = demo_server.client()
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": NESTED}}
    r = await c.chat.completions.create(
        model="sql", messages=MESSAGES, response_format=rf, max_tokens=100, temperature=0
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), NESTED)
    assert r.choices[0].finish_reason == "stop"
    stream = await c.chat.completions.create(
        model="sql",
        messages=MESSAGES,
        response_format=rf,
        max_tokens=100,
        temperature=0,
        stream=True,
    )
    streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert streamed == text


async def test_json_object_and_sampled_n(demo_server):
    c = demo_server.client()
    r = await c.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": ENUM}},
        max_tokens=60,
        temperature=1.0,
        seed=7,
        n=4,
    )
    for ch in r.choices:
        check("enum", ch.message.content)


async def test_every_request_form_gives_the_same_constrained_output(demo_server):
    c = demo_server.client()
    forms = [
        {"structured_outputs": {"regex": REGEX}},
        {"guided_regex": REGEX},
    ]
    outs = []
    for extra in forms:
        r = await c.completions.create(
            model="pirate", prompt="Code:", max_tokens=20, temperature=0, extra_body=extra
        )
        outs.append(r.choices[0].text)
    check("regex", outs[0])
    assert outs[0] == outs[1]
    for extra in ({"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}):
        r = await c.chat.completions.create(
            model="emoji", messages=MESSAGES, max_tokens=10, temperature=0, extra_body=extra
        )
        check("choice", r.choices[0].message.content)
    grammar = 'root ::= "yes" | "no"'  # GBNF; Lark ("start: ...") as well
    for g in (grammar, 'start: "yes" | "no"'):
        r = await c.completions.create(
            model="demo",
            prompt="Ok?",
            max_tokens=5,
            temperature=0,
            extra_body={"guided_grammar": g},
        )
        assert r.choices[0].text in ("yes", "no")
    schema_text = json.dumps(ENUM)  # guided_json may be JSON text
    r = await c.completions.create(
        model="demo", prompt="{", max_tokens=100, extra_body={"guided_json": schema_text}
    )
    check("enum", r.choices[0].text)
    r = await c.completions.create(
        model="demo", prompt="{", max_tokens=100, stream=True,
        extra_body={"structured_outputs": {"json": ENUM}},
    )  # fmt: skip
    check("enum", "".join([ch.choices[0].text async for ch in r]))


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}, "response_format", "Invalid type"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ({"structured_outputs": {"json": {"not": {"type": "string"}}}}, "structured_outputs.json", "not"),
    ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured output"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "set one"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "says"), BAD)
@pytest.mark.parametrize("stream", [False, True])
async def test_bad_constraint_is_a_400_naming_the_field(demo_server, extra, param, says, stream):
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 8, "stream": stream, **extra}
    c = demo_server.client()
    good = asyncio.ensure_future(
        c.chat.completions.create(
            model="sql", messages=MESSAGES, max_tokens=20, temperature=0,
            extra_body={"guided_choice": CHOICES},
        )
    )  # fmt: skip
    url = f"{demo_server.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        assert resp.status == 400, await resp.text()
        err = (await resp.json())["error"]
    assert err["param"] == param and says in err["message"], err
    check("choice", (await good).choices[0].message.content)


async def test_the_engine_serves_on_after_bad_constraints(demo_server):
    c = demo_server.client()
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(
            model="demo", prompt="x", max_tokens=4, extra_body={"guided_regex": "(("}
        )
    r = await c.completions.create(
        model="demo", prompt="x", max_tokens=4, extra_body={"guided_choice": ["a", "b"]}
    )
    assert r.choices[0].text in ("a", "b")
