"""Admin load / unload: only with a token, bearer auth, sources bounded by the allowlist."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from loraplex.engine.adapters.digest import adapter_digest
from tests.helpers.models import copy_adapter
from tests.helpers.server import serve

TOKEN = "s3cret-token"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture
async def admin_server(tiny):
    async for s in serve(tiny, admin_token=TOKEN, local_roots=(str(tiny.extra_root),)):
        yield s


async def _post(url: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_admin_routes_do_not_exist_without_a_token(server, tiny):
    body = {"lora_name": "extra", "lora_path": str(tiny.extra)}
    for path in (LOAD, UNLOAD):
        status, _ = await _post(server.url + path, body, TOKEN)
        assert status == 404


async def test_auth_then_load_serve_and_unload(admin_server, tiny):
    url = admin_server.url
    body = {"lora_name": "extra", "lora_path": str(tiny.extra)}
    status, err = await _post(url + LOAD, body)
    assert status == 401 and err["error"]["type"] == "AuthenticationError"
    status, err = await _post(url + LOAD, body, "wrong-token")
    assert status == 403 and err["error"]["code"] == 403

    digest = adapter_digest(tiny.extra)
    status, ok = await _post(url + LOAD, {**body, "sha256": digest}, TOKEN)
    assert status == 200, ok
    assert ok["name"] == "extra" and ok["digest"] == digest

    client = admin_server.client()
    ids = [m.id for m in (await client.models.list()).data]
    assert "extra" in ids
    r = await client.completions.create(model="extra", prompt=[5, 6], max_tokens=3)
    assert r.model == "extra" and r.usage.completion_tokens >= 1

    status, _ = await _post(url + UNLOAD, {"lora_name": "extra"}, "wrong-token")
    assert status == 403
    status, _ = await _post(url + UNLOAD, {"lora_name": "extra"}, TOKEN)
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="extra", prompt=[5, 6], max_tokens=3)
    status, err = await _post(url + UNLOAD, {"lora_name": "extra"}, TOKEN)
    assert status == 404 and err["error"]["type"] == "NotFoundError"


async def test_load_refusals_are_typed_4xx(admin_server, tiny, tmp_path):
    url = admin_server.url
    # outside the operator's local roots: refused by the allowlist
    outside = {"lora_name": "poem2", "lora_path": str(tiny.adapters["poem"])}
    status, err = await _post(url + LOAD, outside, TOKEN)
    assert status == 403 and err["error"]["type"] == "AdapterPolicyError", err
    # remote URIs must match an --lora-allow pattern (none configured)
    remote = {"lora_name": "hub", "lora_path": "hf://org/repo"}
    status, err = await _post(url + LOAD, remote, TOKEN)
    assert status == 403 and err["error"]["type"] == "AdapterPolicyError", err
    # content does not match the given digest
    bad_sha = {"lora_name": "extra", "lora_path": str(tiny.extra), "sha256": "0" * 64}
    status, err = await _post(url + LOAD, bad_sha, TOKEN)
    assert status == 400 and err["error"]["type"] == "AdapterDigestError", err
    # rank above --max-lora-rank: preflight refuses it
    big = copy_adapter(tiny.extra, tiny.extra_root / "too-big", r=64)
    status, err = await _post(url + LOAD, {"lora_name": "big", "lora_path": str(big)}, TOKEN)
    assert status == 400 and err["error"]["type"].startswith("Adapter"), err
    # malformed bodies
    for body in ({"lora_path": str(tiny.extra)}, {"lora_name": "x y", "lora_path": "/x"}):
        status, err = await _post(url + LOAD, body, TOKEN)
        assert status == 400 and err["error"]["type"] == "BadRequestError", err
