"""Runtime adapter load / unload (vLLM's routes), only when an admin token is configured.

``Authorization: Bearer <token>`` is required: 401 without it, 403 with a wrong one. Sources
stay bounded by the operator's allowlist (``allow_sources`` for remote URIs, ``local_roots``
for local folders), checked here and again by the engine's resolvers.
"""

from __future__ import annotations

import hmac
import re

import structlog
from aiohttp import web

from loraplex.engine.adapters.fetch import valid_adapter_name
from loraplex.engine.server.body import read_json
from loraplex.engine.server.errors import APIError, from_exception
from loraplex.engine.server.state import ADMIN_TOKEN_KEY, ENGINE_KEY

__all__ = ["add_admin_routes", "check_token"]

log = structlog.get_logger("loraplex.server")

_SHA256 = re.compile(r"^(sha256:)?[0-9a-fA-F]{64}$")


def check_token(request: web.Request) -> None:
    """Constant-time bearer token check: 401 when missing, 403 when wrong."""
    token = request.app[ADMIN_TOKEN_KEY]
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise APIError(401, "an admin bearer token is required")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(403, "the admin token is not valid")


def _str_field(body: dict, name: str, *, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name} must be a non-empty string", param=name)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    check_token(request)
    engine = request.app[ENGINE_KEY]
    body = await read_json(request)
    name = _str_field(body, "lora_name")
    uri = _str_field(body, "lora_path")
    sha256 = _str_field(body, "sha256", required=False)
    assert name is not None and uri is not None
    if not valid_adapter_name(name):
        raise APIError(
            400,
            "lora_name may hold letters, digits, '._-' and one '/' (org/name)",
            param="lora_name",
        )
    if name == engine.model_name:
        raise APIError(400, "lora_name must differ from the base model's name", param="lora_name")
    if sha256 is not None and not _SHA256.match(sha256):
        raise APIError(400, "sha256 must be 64 hex digits", param="sha256")
    try:
        # trusted=False: a runtime source must pass the operator's allowlist policy
        info = await engine.add_adapter(
            name, uri, sha256.lower().removeprefix("sha256:") if sha256 else None, trusted=False
        )
    except Exception as e:  # noqa: BLE001
        err = from_exception(e, admin=True)
        log.warning("adapter_load_refused", name=name, uri=uri, status=err.status, error=str(e))
        raise err from e
    log.info("adapter_added", name=name, uri=uri, digest=info["digest"])
    return web.json_response(
        {
            "object": "lora_adapter",
            "message": f"Success: LoRA adapter '{name}' added successfully.",
            **info,
        }
    )


async def unload_lora_adapter(request: web.Request) -> web.Response:
    check_token(request)
    engine = request.app[ENGINE_KEY]
    body = await read_json(request)
    name = _str_field(body, "lora_name")
    try:
        await engine.remove_adapter(name)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001
        raise from_exception(e, admin=True) from e
    log.info("adapter_removed", name=name)
    return web.json_response(
        {
            "object": "lora_adapter",
            "name": name,
            "message": f"Success: LoRA adapter '{name}' removed successfully.",
        }
    )


def add_admin_routes(app: web.Application, token: str) -> None:
    if not token:
        raise ValueError("the admin token must not be empty")
    app[ADMIN_TOKEN_KEY] = token
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
