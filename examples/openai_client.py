"""Talk to a running ``loraplex serve`` with the official ``openai`` client.

Every adapter is a model name: the script lists ``/v1/models`` and streams one completion (or
chat reply with ``--chat``) from the base model and from each adapter in turn.

    loraplex serve                   # another terminal: the demo model with its demo adapters
    python examples/openai_client.py
    python examples/openai_client.py --chat --prompt "Hello, how are you?"
"""

from __future__ import annotations

import argparse
import sys

from openai import OpenAI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--api-key", default="unused", help="sent as the bearer token")
    p.add_argument("--prompt", default="Hello, how are you", help="the prompt for every model")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--model", action="append", help="only these models (repeatable)")
    return p.parse_args(argv)


def stream_one(client: OpenAI, model: str, args: argparse.Namespace) -> str:
    """Stream one reply from ``model`` to stdout as it arrives; returns the finish reason."""
    reason = ""
    if args.chat:
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": args.prompt}],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            stream=True,
        )
        for chunk in chat:
            for choice in chunk.choices:
                print(choice.delta.content or "", end="", flush=True)
                reason = choice.finish_reason or reason
        return reason
    completion = client.completions.create(
        model=model,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        stream=True,
    )
    for chunk in completion:
        for choice in chunk.choices:
            print(choice.text, end="", flush=True)
            reason = choice.finish_reason or reason
    return reason


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    models = [m.id for m in client.models.list()]  # the base model first, then the adapters
    if args.model:
        missing = sorted(set(args.model) - set(models))
        if missing:
            print(f"not served: {', '.join(missing)} (served: {', '.join(models)})")
            return 1
        models = [m for m in models if m in args.model]
    print(f"served models: {', '.join(models)}\n")
    for model in models:
        print(f"--- {model} ---")
        if not args.chat:
            print(args.prompt, end="")
        reason = stream_one(client, model, args)
        print(f"\n[finish_reason: {reason}]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
