"""Slow clients, graceful shutdown, /v1/models visibility and --lora-modules names (issue 12,
item 6 and the SIGTERM drain)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import pytest

from loraplex.engine.demo import demo_adapters
from loraplex.engine.server import create_app_from_config, start_server
from loraplex.engine.server.launch import (
    LoraModule,
    check_lora_modules,
    parse_lora_module,
    shutdown_server,
)
from loraplex.engine.server.limits import ServerLimits
from tests.robustness.server_fixtures import ADMIN, BASE, demo_config, serve_demo, wait_idle

LONG = {"model": BASE, "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """True when the server closes the connection before ``seconds`` pass."""
    try:
        while await asyncio.wait_for(reader.read(1024), seconds):
            pass
        return True
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_slow_and_idle_connections_are_closed():
    limits = ServerLimits(header_timeout=0.5, keep_alive_timeout=0.5, body_timeout=0.5)
    async for server in serve_demo(limits):
        port = server.url.rsplit(":", 1)[1]
        # 1. never sends anything; 2. headers a byte at a time
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        drip_r, drip_w = await asyncio.open_connection("127.0.0.1", port)

        async def drip(w: asyncio.StreamWriter) -> None:
            for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                w.write(bytes([b]))
                await asyncio.sleep(0.1)

        dripping = asyncio.create_task(drip(drip_w))
        assert await _closed_within(idle_r, 20)
        assert await _closed_within(drip_r, 20)
        dripping.cancel()
        await asyncio.gather(dripping, return_exceptions=True)
        # 3. a keep-alive connection left idle after one request
        ka_r, ka_w = await asyncio.open_connection("127.0.0.1", port)
        ka_w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await ka_r.readline()).startswith(b"HTTP/1.1 200")
        assert await _closed_within(ka_r, 20)
        # 4. headers complete, the body never comes: 408 in the error shape
        b_r, b_w = await asyncio.open_connection("127.0.0.1", port)
        b_w.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        head = await asyncio.wait_for(b_r.read(4096), 20)
        assert head.startswith(b"HTTP/1.1 408") and b'"code": 408' in head, head
        assert b"--body-timeout" in head
        for w in (idle_w, drip_w, ka_w, b_w):
            w.close()
        # the server still answers
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/health") as r:
            assert r.status == 200


async def test_models_show_sources_only_to_the_admin():
    async def cards(url: str, headers: dict) -> dict:
        async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models", headers=headers) as r:
            assert r.status == 200
            return {c["id"]: c for c in (await r.json())["data"]}

    async for server in serve_demo():
        anon = await cards(server.url, {})
        wrong = await cards(server.url, {"Authorization": "Bearer not-the-token"})
        admin = await cards(server.url, {"Authorization": f"Bearer {ADMIN}"})
        paths = {name: str(p) for name, p in demo_adapters().items()}
        assert set(anon) == set(admin) == {BASE, *paths}
        for view in (anon, wrong):
            assert all(c["root"] == c["id"] for c in view.values()), view
            assert not any("/" in json.dumps(c["root"]) for c in view.values())
        for name, path in paths.items():
            assert admin[name]["root"] == path
        assert admin[BASE]["root"] != BASE


def test_lora_module_names_follow_the_admin_rules():
    for bad in ("../../x=/tmp/a", "a/b/c=/tmp/a", ".hidden=/tmp/a", '{"name": "..", "uri": "/a"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="sha256"):
        parse_lora_module('{"name": "x", "uri": "/a", "sha256": "abc"}')
    ok = [LoraModule("a", "/x"), LoraModule("org/b", "/y")]
    check_lora_modules(ok, ["base"])
    with pytest.raises(ValueError, match="'a'"):
        check_lora_modules([*ok, LoraModule("a", "/z")])
    with pytest.raises(ValueError, match="'base'"):
        check_lora_modules([LoraModule("base", "/z")], ["base"])


async def test_lora_module_clashing_with_a_demo_adapter_fails_start_up():
    name, path = next(iter(demo_adapters().items()))
    app = create_app_from_config(demo_config(), lora_modules=[LoraModule(name, str(path))])
    with pytest.raises(ValueError, match=repr(name)):
        runner, _ = await start_server(app)
        await runner.cleanup()
    app = create_app_from_config(demo_config(), lora_modules=[LoraModule(BASE, str(path))])
    with pytest.raises(ValueError, match=repr(BASE)):
        runner, _ = await start_server(app)
        await runner.cleanup()


async def _stream_events(url: str, body: dict, started: asyncio.Event) -> list[dict]:
    events = []
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                started.set()
    return events


def _pace_steps(engine, seconds: float) -> None:
    """Each step takes at least ``seconds`` (step thread): the long request's 1000 tokens then
    outlast the shutdown timeout on any machine, however fast the demo model decodes there."""
    executor = engine.testing.executor
    launch = executor.launch

    def paced(*args, **kwargs):
        time.sleep(seconds)
        return launch(*args, **kwargs)

    executor.launch = paced


async def test_shutdown_lets_short_requests_finish_and_aborts_the_rest():
    async for server in serve_demo():
        _pace_steps(server.engine, 0.01)  # >= 10 s for 1000 tokens against a 5 s timeout
        short_started, long_started = asyncio.Event(), asyncio.Event()
        long = asyncio.create_task(_stream_events(server.url, LONG, long_started))
        await long_started.wait()
        short = asyncio.create_task(
            _stream_events(server.url, {**LONG, "max_tokens": 2}, short_started)
        )
        await short_started.wait()  # one token out, one to go: far less than the timeout
        await shutdown_server(server.runner, timeout=5.0)
        short_events, long_events = await short, await long
        # the short one finished on its own within the timeout
        assert short_events[-1]["choices"][0]["finish_reason"] == "length"
        # the long one was aborted, and the stream says why before [DONE]
        finishes = [e["choices"][0]["finish_reason"] for e in long_events if e.get("choices")]
        assert finishes[-1] == "abort"
        err = long_events[-1]["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], err
        assert "--shutdown-timeout" in err["message"]
        # nothing new is accepted
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as s:
                await s.get(f"{server.url}/health")
        await wait_idle(server.engine)
