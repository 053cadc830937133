"""A client that goes away mid-stream aborts its engine request and frees everything."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.helpers.server import BASE


async def _wait_idle(engine, timeout: float = 20.0) -> dict:
    """Poll until nothing runs and nothing is held (no assertion on how fast)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        s = engine.stats()
        refs = s["adapter_refs"].values()
        idle = s["running"] == 0 and s["waiting"] == 0 and s["num_used_blocks"] == 0
        if idle and all(r["users"] == 0 and r["slot_refs"] == 0 for r in refs):
            return s
        assert loop.time() < deadline, s
        await asyncio.sleep(0.05)


async def _read_events_then_leave(url: str, body: dict, events: int) -> list[dict]:
    got = []
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url, json=body)
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                got.append(json.loads(line[6:]))
                if len(got) == events:
                    break
        resp.close()  # drops the connection mid-stream
    return got


async def test_disconnect_mid_stream_aborts_the_request(server):
    before = server.engine.stats()["aborted"]
    body = {
        "model": "poem",
        "prompt": [7, 8, 9],
        "max_tokens": 480,
        "stream": True,
        "ignore_eos": True,
        "n": 2,
    }
    events = await _read_events_then_leave(f"{server.url}/v1/completions", body, 3)
    assert len(events) == 3 and all(e["choices"][0]["finish_reason"] is None for e in events)
    s = await _wait_idle(server.engine)
    assert s["aborted"] >= before + 2  # both choices were aborted, not run to max_tokens

    # chat, on the base model, and the server still answers afterwards
    chat = {
        "model": BASE,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    await _read_events_then_leave(f"{server.url}/v1/chat/completions", chat, 2)
    s = await _wait_idle(server.engine)
    assert s["aborted"] >= before + 3
    r = await server.client().completions.create(model="poem", prompt=[7, 8], max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


async def test_disconnect_during_a_non_streamed_request_aborts_it(server):
    before = server.engine.stats()["aborted"]
    body = {"model": "sql", "prompt": [3, 4, 5], "max_tokens": 480, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(f"{server.url}/v1/completions", json=body))
        while server.engine.stats()["running"] == 0:  # wait until it runs, then hang up
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    s = await _wait_idle(server.engine)
    assert s["aborted"] >= before + 1
