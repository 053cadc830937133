"""A 500's log record names the exception and the request, never a frame's local variables
(request bodies and prompt text live there: rich / structlog's dict tracebacks printed them)."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from loraplex.engine.logging import configure_logging
from loraplex.engine.server.errors import REQUEST_ID_KEY, APIError, error_middleware

SECRET = "hunter2-the-prompt-text"


def _fail(body: str) -> None:
    prompt = body  # a local holding request text, as handlers' frames do
    raise KeyError(f"no such thing ({len(prompt)} chars)")


async def _crash(request: web.Request) -> web.Response:
    request[REQUEST_ID_KEY] = "chatcmpl-1234"
    _fail(SECRET)
    return web.Response()


async def _engine_failure(request: web.Request) -> web.Response:
    secret_body = {"messages": [{"role": "user", "content": SECRET}]}
    try:
        raise RuntimeError(f"step failed on {len(secret_body)} messages")
    except RuntimeError as e:  # as respond.py hands on an engine error: a 500 from its cause
        raise APIError(500, "internal server error") from e


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.mark.parametrize("as_json", [True, False])
async def test_a_500_logs_the_exception_and_request_id_without_locals(restore_logging, as_json):
    out = io.StringIO()
    configure_logging("info", True if as_json else None, stream=out)
    if not as_json:  # the console renderer, as on a terminal
        configure_logging("info", False, stream=out)
    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/crash", _crash)
    app.router.add_post("/engine", _engine_failure)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        r = await client.post("/crash", data=json.dumps({"prompt": SECRET}))
        assert r.status == 500
        reply = await r.json()
        assert "chatcmpl-1234" in reply["error"]["message"]
        r = await client.post("/engine", data="{}")
        assert r.status == 500
        engine_reply = await r.json()
    log = out.getvalue()
    assert SECRET not in log, log
    assert "KeyError" in log and "no such thing" in log and "chatcmpl-1234" in log
    assert "_fail" in log  # the traceback's frames are there, only their locals are not
    assert "RuntimeError" in log and "step failed on 1 messages" in log
    engine_id = engine_reply["error"]["message"].split("request id ")[1].rstrip(")")
    assert engine_id in log


@pytest.mark.parametrize("as_json", [True, False])
def test_logged_exceptions_carry_no_locals(restore_logging, as_json):
    """Every ``log.exception`` (the engine's own included) as the CLI configures logging."""
    out = io.StringIO()
    configure_logging("info", as_json, stream=out)
    try:
        _fail(SECRET)
    except KeyError:
        structlog.get_logger("loraplex.test").exception("step_failed")
    logging.getLogger("aiohttp.test").exception("stdlib", exc_info=KeyError("stdlib failure"))
    log = out.getvalue()
    assert SECRET not in log, log
    assert "KeyError" in log and "_fail" in log and "stdlib failure" in log


async def test_a_completion_500_names_its_reply_id(monkeypatch):
    """Completions name their reply id in a 500's reply (and so its log line), as chat does."""
    from loraplex.engine.server import completions
    from tests.robustness.server_fixtures import serve_demo

    def broken(*a, **kw):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(completions, "make_jobs", broken)
    async for server in serve_demo():
        status, body = await server.post(
            "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 2}
        )
        assert status == 500 and "cmpl-" in body["error"]["message"], body
