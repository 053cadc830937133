"""HTTP errors in the OpenAI / vLLM wire shape, and the mapping from typed engine errors.

Every error body is ``{"error": {"message", "type", "param", "code"}}``.

A 500 is logged once, here, with the request's id (also in the reply, so a client can quote
it), the exception's type and message and its traceback's lines, and never a frame's local
variables: handlers' frames hold request bodies and prompt text. The record carries the
traceback as text rather than ``exc_info``, so no renderer (rich, better_exceptions,
structlog's dict tracebacks) can add the locals back, however logging is configured.
"""

from __future__ import annotations

import asyncio
import traceback
import uuid

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from loraplex.engine.errors import (
    AdapterNotFoundError,
    AdapterPolicyError,
    AdapterTooLargeError,
    EngineClosedError,
    LoRAError,
)
from loraplex.engine.tokenizer import TokenizerError

__all__ = [
    "APIError",
    "error_body",
    "error_response",
    "from_exception",
    "error_middleware",
    "REQUEST_ID_KEY",
]

log = structlog.get_logger("loraplex.server")

# The id of the reply a handler is making (chat: "chatcmpl-..."), set once it is known; a 500
# before that gets an id of its own.
REQUEST_ID_KEY = web.RequestKey("loraplex_request_id", str)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to send as it is: status, message, type, offending parameter."""

    def __init__(
        self, status: int, message: str, *, type: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "APIError")
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.message, type=self.type, param=self.param)

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None):
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def error_response(status: int, message: str, *, param: str | None = None) -> web.Response:
    return APIError(status, message, param=param).response()


def from_exception(
    exc: BaseException, *, model: str | None = None, admin: bool = False
) -> APIError:
    """Map an engine error to an HTTP error.

    ``admin``: the error comes from an operator's load call, so a bad adapter is the caller's
    fault (4xx); for a generation request a configured adapter that fails to load is ours (500).
    """
    if isinstance(exc, APIError):
        return exc
    field = getattr(exc, "field", None)
    if isinstance(exc, AdapterNotFoundError):
        if model is not None:
            return APIError(404, f"The model `{model}` does not exist.", param="model")
        return APIError(404, str(exc), param=field)
    if isinstance(exc, LoRAError):
        kind = type(exc).__name__
        if kind == "SlotFullError":
            return APIError(503, str(exc), type=kind, param=field)
        if isinstance(exc, AdapterPolicyError):
            return APIError(403, str(exc), type=kind, param=field)
        if isinstance(exc, AdapterTooLargeError):
            return APIError(413 if admin else 500, str(exc), type=kind, param=field)
        return APIError(400 if admin else 500, str(exc), type=kind, param=field)
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc))
    if isinstance(exc, (ValueError, TokenizerError)):  # InvalidRequestError, InvalidSamplingParams
        return APIError(400, str(exc), param=field)
    return APIError(500, "internal server error")


def _log_failure(request: web.Request, err: APIError, exc: BaseException) -> APIError:
    """Log a 500 (see the module docstring); the error to send, with the request id."""
    request_id = request.get(REQUEST_ID_KEY) or f"req-{uuid.uuid4().hex}"
    cause = exc.__cause__ if isinstance(exc, APIError) and exc.__cause__ is not None else exc
    log.error(
        "handler_failed",
        path=request.path,
        request_id=request_id,
        error_type=type(cause).__name__,
        error=str(cause),
        traceback="".join(traceback.format_exception(cause)),  # (no locals)
    )
    message = f"{err.message} (request id {request_id})"
    return APIError(err.status, message, type=err.type, param=err.param)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every failure in the error shape (aiohttp's own 404/405 included)."""
    try:
        return await handler(request)
    except APIError as e:
        return (_log_failure(request, e, e) if e.status == 500 else e).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - one bad request must not kill the server
        err = from_exception(e)
        if err.status >= 500:
            err = _log_failure(request, err, e)
        return err.response()
