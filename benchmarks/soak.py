"""Soak: the demo model server under mixed traffic, client disconnects and admin churn.

For ``--duration`` seconds, against the real HTTP server on 127.0.0.1 (demo model, CPU):
- ``--streams`` clients loop over streamed and non-streamed completions / chats on the base
  model and the demo adapters; a ``--disconnect`` share of the streams hangs up mid-way;
- one admin client loads a demo adapter under a fresh name, sends it one request, unloads it;
- one client sends malformed bodies (bad JSON, lone surrogates, over-limit stop lists), which
  must be 4xx.
Reports the process RSS after warm-up and at the end, what is held once traffic stops (KV
blocks, adapter references, running / waiting requests) and the responses by status class.

    python -m benchmarks.soak                       # 60 s
    python -m benchmarks.soak --duration 600 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.record import git_commit
from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.demo import demo_adapters, register_demo_adapters
from loraplex.engine.logging import configure_logging
from loraplex.engine.server import create_app, start_server
from loraplex.engine.server.launch import shutdown_server

ADMIN = "soak-admin-token"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Tally:
    def __init__(self) -> None:
        self.status: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()

    def add(self, kind: str, status: int | str) -> None:
        self.kinds[kind] += 1
        key = status if isinstance(status, str) else f"{status // 100}xx"
        self.status[key] += 1
        if isinstance(status, int) and status >= 500:
            self.status[f"{kind}:{status}"] += 1


def _request(rng: random.Random, models: list[str]) -> tuple[str, dict[str, Any]]:
    model = rng.choice(models)
    common = {"model": model, "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.8])}
    if rng.random() < 0.5:
        prompt: Any = rng.choice(["Once upon a time", "SELECT", "Arr, matey", [5, 6, 7, 8]])
        return "/v1/completions", {**common, "prompt": prompt, "n": rng.choice([1, 1, 2])}
    msgs = [{"role": "user", "content": rng.choice(["Hello!", "Tell me a story", "Write SQL"])}]
    return "/v1/chat/completions", {**common, "messages": msgs}


async def traffic(s: aiohttp.ClientSession, url: str, rng: random.Random, models: list[str],
                  disconnect: float, tally: Tally, stop: float) -> None:  # fmt: skip
    while time.monotonic() < stop:
        path, body = _request(rng, models)
        stream = rng.random() < 0.6
        body["stream"] = stream
        cut = stream and rng.random() < disconnect
        kind = "disconnect" if cut else ("stream" if stream else "json")
        try:
            async with s.post(f"{url}{path}", json=body) as r:
                if cut:
                    n = rng.randint(1, 4)
                    async for line in r.content:
                        n -= line.startswith(b"data: ")
                        if n <= 0:
                            break
                    r.close()  # hang up mid-stream
                    tally.add(kind, "cut")
                    continue
                await r.read()
                tally.add(kind, r.status)
        except aiohttp.ClientError as e:
            tally.add(kind, type(e).__name__)


async def admin_churn(s: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally,
                      stop: float) -> int:  # fmt: skip
    sources = list(demo_adapters().values())
    auth = {"Authorization": f"Bearer {ADMIN}"}
    rounds = 0
    while time.monotonic() < stop:
        name = f"churn-{rounds}"
        body = {"lora_name": name, "lora_path": str(rng.choice(sources))}
        async with s.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth) as r:
            await r.read()
            tally.add("admin_load", r.status)
        req = {"model": name, "prompt": "Hello", "max_tokens": 4}
        async with s.post(f"{url}/v1/completions", json=req) as r:
            await r.read()
            tally.add("churn_request", r.status)
        async with s.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name},
                          headers=auth) as r:  # fmt: skip
            await r.read()
            tally.add("admin_unload", r.status)
        rounds += 1
        await asyncio.sleep(0.2)
    return rounds


_BAD = [
    b"{not json",
    b'{"model": "demo", "prompt": "\\ud800"}',
    json.dumps({"model": "demo", "prompt": "hi", "stop": ["x"] * 1000}).encode(),
    b'{"model": "demo", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
]


async def hostile(s: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally,
                  stop: float) -> None:  # fmt: skip
    headers = {"Content-Type": "application/json"}
    while time.monotonic() < stop:
        async with s.post(f"{url}/v1/completions", data=rng.choice(_BAD), headers=headers) as r:
            await r.read()
            tally.add("hostile", r.status)
        await asyncio.sleep(0.05)


async def held(engine: AsyncEngine, timeout: float = 30.0) -> dict[str, Any]:
    """What the engine still holds once traffic stopped (polls until idle or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        refs = s["adapter_refs"].values()
        out = {
            "running": s["running"],
            "waiting": s["waiting"],
            "kv_blocks_used": s["num_used_blocks"],
            "adapter_users": sum(r["users"] for r in refs),
            "adapter_slot_refs": sum(r["slot_refs"] for r in refs),
        }
        if not any(out.values()) or time.monotonic() > deadline:
            return out
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = EngineConfig(model=None, device="cpu", served_model_name="demo", max_loras=2,
                          max_cpu_loras=4,
                          local_roots=(str(next(iter(demo_adapters().values())).parent),))  # fmt: skip
    async with AsyncEngine(config) as engine:
        names = await register_demo_adapters(engine)
        runner, port = await start_server(create_app(engine, admin_token=ADMIN))
        url = f"http://127.0.0.1:{port}"
        tally = Tally()
        t0 = time.monotonic()
        warm = t0 + min(30.0, args.duration * 0.1)
        stop = t0 + args.duration
        samples: list[tuple[float, float]] = []

        async def sample() -> None:
            while time.monotonic() < stop:
                samples.append((time.monotonic() - t0, rss_mib()))
                await asyncio.sleep(1.0)

        async with aiohttp.ClientSession() as s:
            tasks = [
                traffic(
                    s,
                    url,
                    random.Random(rng.random()),
                    ["demo", *names],
                    args.disconnect,
                    tally,
                    stop,
                )  # fmt: skip
                for _ in range(args.streams)
            ]
            results = await asyncio.gather(
                *tasks, admin_churn(s, url, rng, tally, stop), hostile(s, url, rng, tally, stop),
                sample(),
            )  # fmt: skip
        leftovers = await held(engine)
        after_warm = [r for t, r in samples if t >= warm - t0] or [r for _, r in samples]
        stats = engine.stats()
        await shutdown_server(runner, timeout=5)
    return {
        "duration_s": args.duration,
        "streams": args.streams,
        "disconnect_share": args.disconnect,
        "requests": dict(tally.kinds),
        "responses": dict(tally.status),
        "admin_rounds": results[args.streams],
        "rss_mib_after_warmup": round(after_warm[0], 1),
        "rss_mib_end": round(after_warm[-1], 1),
        "rss_mib_max": round(max(after_warm), 1),
        "rss_growth_pct": round(100 * (after_warm[-1] / after_warm[0] - 1), 2),
        "held_after": leftovers,
        "engine_counters": {k: stats.get(k) for k in ("finished", "aborted", "errors")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    ap.add_argument("--streams", type=int, default=8, help="concurrent traffic clients")
    ap.add_argument("--disconnect", type=float, default=0.5, help="share of streams cut off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    configure_logging("warning")  # one log line per request would drown the report
    report = {"commit": git_commit() or "unknown", **asyncio.run(run(args))}
    print(f"soak {args.duration:g} s, {args.streams} clients, commit {report['commit']}")
    rows = [
        ("RSS after warm-up (MiB)", report["rss_mib_after_warmup"]),
        ("RSS at end (MiB)", report["rss_mib_end"]),
        ("RSS growth", f"{report['rss_growth_pct']} %"),
        ("held after: KV blocks", report["held_after"]["kv_blocks_used"]),
        ("held after: adapter users / slot refs",
         f"{report['held_after']['adapter_users']} / {report['held_after']['adapter_slot_refs']}"),
        ("held after: running / waiting",
         f"{report['held_after']['running']} / {report['held_after']['waiting']}"),
        ("admin load/unload rounds", report["admin_rounds"]),
    ] + [(f"responses {k}", v) for k, v in sorted(report["responses"].items())]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
