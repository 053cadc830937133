"""Request bodies that ended the server's process before the grammar sandbox (issue: "No
request can crash..."), sent to ``loraplex serve`` running in its own process: each is a 400
naming its field, the server keeps serving, a second client's stream keeps its gaps within the
isolation bound (gaps.py), and each refused input is logged once, without its text."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from tests.robustness.gaps import attack, check_gaps
from tests.robustness.server_fixtures import free_port, wait_up
from tests.structured.hostile import defs_chain, rule_chain

CLI = [sys.executable, "-m", "loraplex.engine.server.cli"]
INT_SCHEMA = {"type": "integer", "minimum": -2e19, "maximum": -1e19}

CRASHERS = {
    # SIGSEGV in the grammar library (an 80-byte body), as response_format and as a tool
    "integer bounds": ("/v1/completions", "response_format", {
        "prompt": "hi", "max_tokens": 4,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": INT_SCHEMA}}}),
    "integer bounds in a tool": ("/v1/chat/completions", "tools", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": INT_SCHEMA}}}}],
        "tool_choice": "required"}),
    # stack overflows in the compile thread: 1,000 $defs links, 3,000 grammar rules
    "deep definitions": ("/v1/completions", "guided_json", {
        "prompt": "hi", "max_tokens": 4, "guided_json": defs_chain(1000)}),
    "deep definitions (response_format)": ("/v1/completions", "response_format", {
        "prompt": "hi", "max_tokens": 4,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "d", "schema": defs_chain(1000)}}}),
    "rule chain": ("/v1/completions", "guided_grammar", {
        "prompt": "hi", "max_tokens": 4, "guided_grammar": rule_chain(3000)}),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [*CLI, "serve", "--device", "cpu", "--port", str(port), "--log-json"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
        try:
            wait_up(proc, url)
            yield url, proc, log
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{url}{path}", data=json.dumps({"model": "demo", **body}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _serving(url: str, proc: subprocess.Popen) -> None:
    assert proc.poll() is None, f"the server died (exit code {proc.returncode})"
    status, body = _post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert status == 200 and body["choices"][0]["text"] is not None, body
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        assert r.status == 200


@pytest.mark.parametrize("name", list(CRASHERS))
def test_a_crashing_body_is_a_400_and_the_server_lives_on(server, name):
    url, proc, _ = server
    path, param, body = CRASHERS[name]
    for _ in range(2):  # the second time from what the first one taught the cache
        status, reply = _post(url, path, body)
        assert status == 400, reply
        assert reply["error"]["param"] == param, reply
        _serving(url, proc)


def test_each_refused_input_is_logged_once_without_its_text(server):
    url, proc, log = server
    _, _, body = CRASHERS["rule chain"]
    for _ in range(3):
        assert _post(url, "/v1/completions", body)[0] == 400
    time.sleep(0.5)  # (the log line is written before the reply; flushed by now)
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    refused = [x for x in lines if x.get("event") == "grammar_refused"]
    assert refused and all(x["reason"] in ("crash", "timeout") for x in refused)
    digests = [x["constraint_sha256"] for x in refused]
    assert len(digests) == len(set(digests))  # once per input
    text = log.read_text()
    assert 'r2999: \\"a\\"' not in text and 'r2999: "a"' not in text  # never the request's text


@pytest.mark.parametrize("name", ["integer bounds", "deep definitions"])
async def test_other_streams_keep_flowing_while_crashers_arrive(server, name, tmp_path):
    url, proc, _ = server
    path, _, body = CRASHERS[name]
    if name == "deep definitions":  # a fresh schema, so the attack reaches the sandbox
        body = {**body, "guided_json": {**defs_chain(1000), "description": str(time.time_ns())}}
    file = tmp_path / "body.json"
    file.write_bytes(json.dumps({"model": "demo", **body}).encode())
    statuses = await check_gaps(url, functools.partial(attack, url, path, file))
    assert statuses and set(statuses) == {400}, statuses
    await asyncio.to_thread(_serving, url, proc)
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models") as r:
        assert r.status == 200
