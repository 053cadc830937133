"""Reading a JSON request body under the server's limits.

The body is read by the app itself, within ``body_timeout`` and ``max_request_body_bytes``
(counted after decompression, so a small gzip bomb is refused as early as a big body), decoded
from ``Content-Encoding`` identity / gzip / deflate (anything else: 415), then parsed. Every
failure is an ``APIError`` in the OpenAI error shape.

NOTE: ``start_server`` runs aiohttp with ``auto_decompress=False`` so that an encoding it cannot
decode (``br`` without brotli) reaches this module instead of becoming a plain-text 400 inside
aiohttp's protocol; ``BODY_DECODED_KEY`` tells this module that aiohttp left the body alone.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from loraplex.engine.server.errors import APIError
from loraplex.engine.server.limits import ServerLimits, flag
from loraplex.engine.server.state import BODY_DECODED_KEY, LIMITS_KEY, PREP_POOL_KEY

__all__ = ["read_body", "read_json", "read_request", "parse_json", "check_depth", "INLINE_BYTES"]

T = TypeVar("T")
INLINE_BYTES = 64 << 10  # request bodies parsed on the event loop (bigger: in prep threads)

_READ_CHUNK = 1 << 16


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes ({flag('max_request_body_bytes')})",
    )


class _Decoder:
    """Incremental Content-Encoding decoder that never produces more than ``limit`` bytes."""

    def __init__(self, encoding: str, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.encoding = encoding
        if encoding in ("", "identity"):
            self._z = None
        elif encoding in ("gzip", "x-gzip"):
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._z = zlib.decompressobj(zlib.MAX_WBITS)  # zlib-wrapped, as RFC 9110 says
        else:
            raise APIError(
                415,
                f"Content-Encoding {encoding!r} is not supported (use gzip, deflate or identity)",
            )

    def _count(self, data: bytes) -> bytes:
        self.size += len(data)
        if self.size > self.limit:
            raise _too_large(self.limit)
        return data

    def feed(self, chunk: bytes) -> bytes:
        if self._z is None:
            return self._count(chunk)
        try:
            # NOTE: max_length bounds the output of this call: a bomb stops at limit + 1 bytes.
            out = self._z.decompress(chunk, self.limit - self.size + 1)
        except zlib.error as e:
            raise APIError(400, f"the body is not valid {self.encoding} data: {e}") from None
        return self._count(out)

    def finish(self) -> bytes:
        if self._z is None:
            return b""
        if not self._z.eof:
            raise APIError(400, f"the {self.encoding} body is truncated")
        if self._z.unused_data:
            raise APIError(400, f"the {self.encoding} body has trailing data")
        return b""


async def _read(request: web.Request, limits: ServerLimits, encoding: str) -> bytes:
    decoder = _Decoder(encoding, limits.max_request_body_bytes)
    parts = []
    while True:
        chunk = await request.content.read(_READ_CHUNK)
        if not chunk:
            break
        parts.append(decoder.feed(chunk))
    parts.append(decoder.finish())
    return b"".join(parts)


async def read_body(request: web.Request) -> bytes:
    """The decoded request body, within the size and time limits."""
    limits = request.app[LIMITS_KEY]
    length = request.content_length
    if length is not None and length > limits.max_request_body_bytes:
        raise _too_large(limits.max_request_body_bytes)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if not request.app.get(BODY_DECODED_KEY, False):
        encoding = ""  # aiohttp decoded it already (or refused it before we got here)
    try:
        return await asyncio.wait_for(_read(request, limits, encoding), limits.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request body took longer than {limits.body_timeout:g} s to arrive "
            f"({flag('body_timeout')})",
        ) from None  # fmt: skip
    except (ConnectionError, web.RequestPayloadError, HttpProcessingError) as e:
        raise APIError(400, f"the request body could not be read: {e}") from None


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def read_json(request: web.Request) -> dict[str, Any]:
    return parse_json(await read_body(request))


async def read_request(request: web.Request, parse: Callable[[dict[str, Any]], T]) -> T:
    """``parse(body)`` of the request's JSON body: on the loop for a small body, in the app's
    preparation threads past ``INLINE_BYTES``. NOTE: checking a large body is Python loops over
    its items (a 60k-entry choice list: ~60-120 ms on a busy 2-core machine); on the loop that
    is one stall of every stream, in a thread the loop keeps its turns of the GIL."""
    raw = await read_body(request)
    if len(raw) <= INLINE_BYTES:
        return parse(parse_json(raw))
    pool = request.app.get(PREP_POOL_KEY)
    return await asyncio.get_running_loop().run_in_executor(pool, lambda: parse(parse_json(raw)))


def check_depth(value: Any, limit: int, param: str) -> None:
    """Refuse ``value`` when arrays / objects nest deeper than ``limit`` inside it (iterative)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            raise APIError(
                400,
                f"{param} nests JSON deeper than {limit} levels ({flag('max_json_depth')})",
                param=param,
            )
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
