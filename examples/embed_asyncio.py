"""Embed loraplex in an asyncio app: streams on different adapters share one engine.

A heartbeat task keeps ticking (the event loop is never blocked by the model) while one stream
per adapter, plus one on the base model, generates concurrently; chunks print as they arrive,
interleaved, then a summary per stream.

    python examples/embed_asyncio.py                      # demo model and its adapters, CPU ok
    python examples/embed_asyncio.py --model DIR --adapter sql=/path/to/sql-lora
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time

import structlog

from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams

BASE = "base"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="HF model folder (default: the built-in demo model)")
    p.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH",
        help="a PEFT LoRA folder to serve (repeatable; default: the demo adapters)",
    )  # fmt: skip
    p.add_argument("--prompt", default="Hello, how are you", help="the prompt of every stream")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per stream")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--heartbeat", type=float, default=0.25, help="seconds between ticks")
    p.add_argument("--verbose", action="store_true", help="show the engine's own log lines")
    return p.parse_args(argv)


def adapters_from(args: argparse.Namespace) -> dict[str, str]:
    """NAME -> folder: the --adapter options, or the demo adapters when no --model is given."""
    if args.adapter:
        pairs = [a.split("=", 1) for a in args.adapter]
        if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
            raise SystemExit("--adapter expects NAME=PATH")
        return dict(pairs)
    if args.model is None:
        from loraplex.engine.demo import demo_adapters

        return {name: str(path) for name, path in demo_adapters().items()}
    return {}


async def heartbeat(done: asyncio.Event, period: float) -> int:
    """Print a tick every ``period`` seconds until ``done``; returns the number of ticks."""
    t0, ticks = time.monotonic(), 0
    while not done.is_set():
        ticks += 1
        print(f"  [heartbeat #{ticks} at {time.monotonic() - t0:5.2f}s]", flush=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=period)
    return ticks


async def stream(
    engine: AsyncEngine, label: str, prompt: str, params: SamplingParams, adapter: str | None
) -> tuple[str, str, str]:
    """Run one request, printing every chunk; returns (label, text, finish reason)."""
    text, reason = "", ""
    async for out in engine.generate(prompt, params, adapter=adapter):
        if out.text:
            print(f"{label:>14} | {out.text!r}", flush=True)
        text += out.text
        reason = out.finish_reason or reason
    return label, text, reason


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.verbose:  # the host app owns logging: keep the engine's info lines quiet
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    adapters = adapters_from(args)
    n = len(adapters)
    config = EngineConfig(
        model=args.model, device=args.device, max_loras=max(4, n), max_cpu_loras=max(8, n)
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    async with AsyncEngine(config) as engine:
        for name, path in adapters.items():
            await engine.add_adapter(name, path)
        print(f"model {engine.model_name!r}, adapters: {', '.join(adapters) or 'none'}")
        print(f"prompt: {args.prompt!r}\n")
        done = asyncio.Event()
        ticker = asyncio.create_task(heartbeat(done, args.heartbeat))
        jobs = [stream(engine, BASE, args.prompt, params, None)]
        jobs += [stream(engine, name, args.prompt, params, name) for name in adapters]
        try:
            results = await asyncio.gather(*jobs)
        finally:
            done.set()
            ticks = await ticker
    print(f"\n{len(results)} streams done, {ticks} heartbeats meanwhile:")
    for label, text, reason in results:  # line breaks shown as " / ", verse style
        print(f"{label:>14} : {args.prompt}{text}  [{reason}]".replace("\n", " / "))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
