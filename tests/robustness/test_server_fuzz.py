"""Property-based fuzzing of request parsing (issue 12): random JSON shapes and field values
for completions and chat give a 4xx error in the OpenAI shape or a success, never a 500; the
server then serves the same greedy completion, and no KV block or adapter reference is left."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.server.limits import ServerLimits
from tests.robustness.server_fixtures import BASE, assert_error, greedy_text, serve_demo, wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMITS = ServerLimits(max_request_body_bytes=256 << 10, max_prompts_times_n=8)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Text with lone surrogates, controls and non-BMP characters mixed in.
text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["\ud800", "a\udfffb", "<|user|>", "", "{{ 7*7 }}", "{% for x in y %}"]
)
scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | text
json_value = st.recursive(
    scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=20,
)
small = st.integers(-3, 40)
token_ids = st.lists(st.integers(-5, 800), min_size=0, max_size=8)

common = {
    "model": st.sampled_from([BASE, "pirate", "sql", "nope", "", "../x"]) | json_value,
    "max_tokens": small | json_value,
    "n": st.integers(-1, 4) | json_value,
    "temperature": st.floats(-1, 3) | json_value,
    "top_p": st.floats(-0.5, 1.5) | json_value,
    "top_k": small | json_value,
    "seed": st.integers(-5, 2**65) | json_value,
    "stop": st.lists(text, max_size=4) | text | json_value,
    "stop_token_ids": token_ids | json_value,
    "stream": st.booleans() | json_value,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_value,
    "ignore_eos": st.booleans() | json_value,
    "min_tokens": small | json_value,
    "logprobs": st.integers(-1, 25) | json_value,
    "best_of": small | json_value,
    "return_token_ids": st.booleans() | json_value,
}
completion = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            text, st.lists(text, max_size=3), token_ids, st.lists(token_ids, max_size=3), json_value
        )
    },  # fmt: skip
    optional=common,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | json_value},
    optional={
        "content": text
        | st.lists(
            st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2
        )  # fmt: skip
        | json_value,
        "name": json_value,
    },
)
chat = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3) | json_value},
    optional={
        **common,
        "chat_template_kwargs": st.dictionaries(text, json_value, max_size=3) | json_value,
        "add_generation_prompt": st.booleans() | json_value,
        "top_logprobs": st.integers(-1, 25) | json_value,
        "max_completion_tokens": small | json_value,
    },
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    async for s in serve_demo(LIMITS):
        s.reference = await greedy_text(s)  # type: ignore[attr-defined]
        yield s


def _cap(body: dict) -> dict:
    """Keep every example short to run: at most 4 new tokens per choice."""
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)
    else:
        body.setdefault("max_tokens", 4)
    if isinstance(body.get("max_completion_tokens"), int):
        body["max_completion_tokens"] = min(body["max_completion_tokens"], 4)
    return body


async def _check(server, path: str, raw: bytes) -> None:
    status, reply = await server.post(path, raw, {"Content-Type": "application/json"})
    assert status < 500, (status, raw[:300], reply)
    if status >= 400:
        assert_error(reply, status)
    elif reply is not None:  # a JSON body; streams are SSE text (None here)
        assert "choices" in reply, reply


@pytest.mark.parametrize("path, strategy", [("/v1/completions", completion),
                                            ("/v1/chat/completions", chat)])  # fmt: skip
async def test_random_requests_never_500(server, path, strategy):
    bodies: list[bytes] = []

    @FUZZ
    @given(strategy)
    def collect(body):
        bodies.append(json.dumps(_cap(body)).encode())

    collect()  # hypothesis drives the generation; the async checks run below
    for raw in bodies:
        await _check(server, path, raw)
    await wait_idle(server.engine)
    assert await greedy_text(server) == server.reference


@FUZZ
@given(json_value)
def _shapes(value):
    _SHAPES.append(json.dumps(value).encode())


_SHAPES: list[bytes] = []


async def test_random_json_shapes_never_500(server):
    _shapes()
    for raw in _SHAPES:
        for path in ("/v1/completions", "/v1/chat/completions"):
            await _check(server, path, raw)
    await wait_idle(server.engine)
    assert await greedy_text(server) == server.reference
