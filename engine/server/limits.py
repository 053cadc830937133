"""What one HTTP request may cost before it is admitted, and how long a client may dawdle.

Every bound is a ``loraplex serve`` flag; an error that a bound causes names its flag, so an
operator who meets it knows what to raise. Checked in this order: body bytes (before the body is
read), JSON depth (while parsing), prompt characters, prompts × n and stop lists (before any
tokenization), then the token count against the context length.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace

__all__ = ["ServerLimits", "add_limit_arguments", "limits_from_args", "CHARS_PER_TOKEN"]

CHARS_PER_TOKEN = 32  # far above any tokenizer's average (English ~4, code ~3)


@dataclass(frozen=True)
class ServerLimits:
    # NOTE: json.loads runs on the event loop and holds the GIL (~100-200 ms per MiB of
    # pathological JSON on a slow CPU), so the body bound is also the parse-time bound.
    max_request_body_bytes: int = 2 << 20  # a 128k-token id prompt is ~0.9 MB of JSON
    max_json_depth: int = 32  # containers inside containers; real requests nest < 6
    # all text prompts / message strings of one request; None: CHARS_PER_TOKEN × context length
    # NOTE: even off the loop, the tokenizer binding holds the GIL to build and free the token
    # list (~0.1-0.2 s per million characters), so a prompt that cannot fit is refused unread.
    max_prompt_chars: int | None = None
    max_prompts_times_n: int = 128  # engine requests one API request may create
    max_stop_strings: int = 32  # entries of ``stop``, and of ``stop_token_ids``
    max_stop_string_chars: int = 256  # the longest stop string
    # Slow clients: the first request's headers, the body, the idle time between requests.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    # SIGTERM: running requests get this long to finish, then they are aborted.
    shutdown_timeout: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0:
                raise ValueError(f"{f.name} must be > 0, got {value}")

    def for_context(self, max_model_len: int) -> ServerLimits:
        """These limits with ``max_prompt_chars`` resolved for a model's context length."""
        if self.max_prompt_chars is not None:
            return self
        return replace(self, max_prompt_chars=CHARS_PER_TOKEN * max_model_len)


_HELP = {
    "max_request_body_bytes": "largest request body (after decompression) in bytes",
    "max_json_depth": "deepest nesting of JSON arrays / objects in a request body",
    "max_prompt_chars": "characters of all text prompts (or chat message strings) of a request "
    f"(default: {CHARS_PER_TOKEN} per token of the context length)",
    "max_prompts_times_n": "prompts × n of one request (each is one engine request)",
    "max_stop_strings": "entries of stop, and of stop_token_ids, per request",
    "max_stop_string_chars": "characters of the longest stop string",
    "header_timeout": "seconds a new connection has to send its first request's headers",
    "body_timeout": "seconds a client has to send a request body",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open",
    "shutdown_timeout": "seconds running requests get to finish after SIGTERM before abort",
}


def flag(name: str) -> str:
    """The command-line flag of a limit: ``max_prompt_chars`` -> ``--max-prompt-chars``."""
    return "--" + name.replace("_", "-")


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    for f in fields(ServerLimits):
        kind = int if f.default is None else type(f.default)
        metavar = "N" if kind is int else "SECONDS"
        p.add_argument(
            flag(f.name), type=kind, default=f.default, metavar=metavar, help=_HELP[f.name]
        )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
