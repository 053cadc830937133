"""HTTP errors in the OpenAI / vLLM wire shape, and the mapping from typed engine errors.

Every error body is ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from loraplex.engine.errors import EngineClosedError
from loraplex.engine.lora.errors import (
    AdapterNotFoundError,
    AdapterPolicyError,
    AdapterTooLargeError,
    LoRAError,
)
from loraplex.engine.tokenizer import TokenizerError

__all__ = ["APIError", "error_body", "error_response", "from_exception", "error_middleware"]

log = structlog.get_logger("loraplex.server")

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


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every failure in the error shape (aiohttp's own 404/405 included)."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - one bad request must not kill the server
        err = from_exception(e)
        if err.status >= 500:
            log.exception("handler_failed", path=request.path)
        return err.response()
