"""2 CPU replicas of the demo model behind the ingress (conftest.py): answers equal to
``loraplex serve``, runtime adapters on every replica, listeners on the loopback only, a
replica killed mid-stream, and the CLI joining the cluster (routing by residency is
test_cluster_routing.py). The order matters only for the last two (they take replicas or the
app away): conftest.py runs this file after every other test of the cluster."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

pytest.importorskip("ray.serve")

from loraplex.engine.demo import demo_adapters  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.ray_cluster import ADMIN_TOKEN, FLAGS, PROMPT, Cluster, wait_for

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _models(cluster: Cluster) -> list[str]:
    return ["demo", *demo_adapters()]


def _post(url: str, path: str, body: dict, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- the same answers as loraplex serve -----------------------------------------------------------


def test_every_demo_adapter_answers_as_loraplex_serve(cluster: Cluster):
    ours, ref = cluster.client(), cluster.client(cluster.reference_url)
    assert [m.id for m in ours.models.list().data] == [m.id for m in ref.models.list().data]
    for model in _models(cluster):
        kw = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0)
        extra = {"return_token_ids": True}
        a = ours.completions.create(**kw, extra_body=extra).choices[0]
        b = ref.completions.create(**kw, extra_body=extra).choices[0]
        assert a.token_ids == b.token_ids and a.text == b.text, model  # type: ignore[attr-defined]
        assert a.finish_reason == b.finish_reason
        streamed = [c.choices[0] for c in ours.completions.create(**kw, stream=True)]
        ref_streamed = [c.choices[0] for c in ref.completions.create(**kw, stream=True)]
        assert "".join(c.text for c in streamed) == b.text, model
        assert [c.text for c in streamed] == [c.text for c in ref_streamed]
        assert streamed[-1].finish_reason == b.finish_reason
        ckw = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0.0)
        chat = ours.chat.completions.create(**ckw).choices[0].message.content
        assert chat == ref.chat.completions.create(**ckw).choices[0].message.content, model
        chunks = ours.chat.completions.create(**ckw, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat


def test_a_composition_answers_as_loraplex_serve(cluster: Cluster):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "adapters": [{"name": "sql", "weight": 0.7}, {"name": "pirate", "weight": 0.3}]}  # fmt: skip
    ours = _post(cluster.url, "/v1/completions", body)
    ref = _post(cluster.reference_url, "/v1/completions", body)
    assert ours[0] == ref[0] == 200, ours
    assert ours[1]["choices"] == ref[1]["choices"]


def test_errors_have_the_wire_shape_of_loraplex_serve(cluster: Cluster):
    for body in (
        {"model": "no-such-adapter", "prompt": "x", "max_tokens": 2},
        {"model": "demo", "prompt": "x", "max_tokens": -1},
        {"model": "demo", "prompt": "x", "max_tokens": 2, "n": 0},
        {"model": "pirate", "prompt": [10**9], "max_tokens": 2},  # refused by the engine
    ):
        ours = _post(cluster.url, "/v1/completions", body)
        ref = _post(cluster.reference_url, "/v1/completions", body)
        assert ours == ref and ours[0] >= 400, body


# -- runtime adapters -------------------------------------------------------------------------------


def test_admin_load_reaches_every_replica_and_unload_leaves_none(cluster: Cluster):
    path = str(demo_adapters()["sql"])
    body = {"lora_name": "runtime-sql", "lora_path": path}
    assert _post(cluster.url, "/v1/load_lora_adapter", body)[0] == 401
    status, reply = _post(cluster.url, "/v1/load_lora_adapter", body, ADMIN_TOKEN)
    assert status == 200, reply
    ref = _post(cluster.reference_url, "/v1/load_lora_adapter", body, ADMIN_TOKEN)
    assert ref[1]["digest"] == reply["digest"]

    def everywhere(present: bool) -> bool:
        reports = cluster.engine.board.snapshot()[0]
        return len(reports) == 2 and all(
            ("runtime-sql" in r.get("adapters", ())) == present for r in reports.values()
        )

    wait_for(lambda: everywhere(True), 30, "the adapter on both replicas")
    ours = cluster.client().completions.create(
        model="runtime-sql", prompt=PROMPT, max_tokens=6, temperature=0.0
    )
    theirs = cluster.client(cluster.reference_url).completions.create(
        model="runtime-sql", prompt=PROMPT, max_tokens=6, temperature=0.0
    )
    assert ours.choices[0].text == theirs.choices[0].text
    outside = {"lora_name": "outside", "lora_path": "/etc"}
    status, err = _post(cluster.url, "/v1/load_lora_adapter", outside, ADMIN_TOKEN)
    assert (status, err) == _post(
        cluster.reference_url, "/v1/load_lora_adapter", outside, ADMIN_TOKEN
    )
    unload = {"lora_name": "runtime-sql"}
    assert _post(cluster.url, "/v1/unload_lora_adapter", unload, ADMIN_TOKEN)[0] == 200
    wait_for(lambda: everywhere(False), 30, "the adapter gone from both replicas")
    status, err = _post(cluster.url, "/v1/completions", {"model": "runtime-sql", "prompt": "x"})
    assert status == 404 and err["error"]["param"] == "model"


def test_example_client_runs_against_the_ingress(cluster: Cluster):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "ray_serve",
                          "route_adapters.py")  # fmt: skip
    out = subprocess.run(
        [sys.executable, script, "--base-url", cluster.url, "--requests", "6"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "requests per adapter" in out.stdout
    assert "loraplex_route_decisions_total{" in out.stdout


def _tcp_listeners() -> dict[int, str]:
    """Socket inode -> local address of every listening TCP socket (Linux /proc)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] != "0A":  # LISTEN
                    continue
                hexaddr = cols[1].split(":")[0]
                raw = b"".join(
                    bytes.fromhex(hexaddr[i : i + 8])[::-1] for i in range(0, len(hexaddr), 8)
                )
                found[int(cols[9])] = str(ipaddress.ip_address(raw))
    return found


def _ray_processes(temp_dir: str) -> set[int]:
    """This session's Ray processes: those started with its temp dir, their descendants, and
    this process (the driver)."""
    parent, roots = {}, {os.getpid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if temp_dir.encode() in f.read():
                    roots.add(int(entry))
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    found, grew = set(roots), True
    while grew:
        more = {p for p, pp in parent.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc")
def test_local_cluster_listens_on_loopback_only(cluster: Cluster):
    listeners = _tcp_listeners()
    seen = {}
    for pid in _ray_processes(cluster.temp_dir):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listeners:
                    seen[(pid, inode)] = listeners[inode]
    assert len({pid for pid, _ in seen}) >= 4, seen  # gcs, raylet, replicas, this driver ...
    for pid in {int(r["pid"]) for r in cluster.engine.board.snapshot()[0].values()}:
        assert any(p == pid for p, _ in seen), f"replica {pid} not found"

    def loopback(addr: str) -> bool:
        ip = ipaddress.ip_address(addr)
        mapped = getattr(ip, "ipv4_mapped", None)
        return ip.is_loopback or (mapped is not None and mapped.is_loopback)

    wide = {k: a for k, a in seen.items() if not loopback(a)}
    assert not wide, f"listening beyond the loopback: {wide}"


# -- a replica dies ----------------------------------------------------------------------------------


def test_killed_replica_fails_its_stream_others_complete_new_requests_succeed(cluster: Cluster):
    import ray

    client = cluster.client()
    # a runtime adapter: the replacement replica must be given it too
    body = {"lora_name": "runtime-pirate", "lora_path": str(demo_adapters()["pirate"])}
    assert _post(cluster.url, "/v1/load_lora_adapter", body, ADMIN_TOKEN)[0] == 200
    kw = dict(model="demo", prompt=PROMPT, max_tokens=600, temperature=0.0,
              extra_body={"ignore_eos": True})  # fmt: skip
    doomed = client.completions.create(**kw, stream=True)
    first = next(iter(doomed))
    victim = cluster.engine.replica_of(f"{first.id}-0-0")
    assert victim is not None
    # a stream on the other replica: the lighter one takes it, unless a replica's load report
    # lags (an earlier test's stream on the other one): then retry (routing is tested apart)
    for _ in range(8):
        survivor_stream = client.completions.create(**{**kw, "max_tokens": 40}, stream=True)
        survivor_first = next(iter(survivor_stream))
        survivor = cluster.engine.replica_of(f"{survivor_first.id}-0-0")
        if survivor not in (None, victim):
            break
        survivor_stream.close()
    assert survivor not in (None, victim)

    actor = ray.get_actor(f"SERVE_REPLICA::loraplex#engine#{victim}", namespace="serve")
    ray.kill(actor, no_restart=True)
    # the stream on the dead replica ends with a 503-style error event (httpx raises it)
    with pytest.raises(openai.APIError) as info:
        for _ in doomed:
            pass
    assert "replica" in str(info.value.message) and "failed" in str(info.value.message)
    assert "".join(c.choices[0].text for c in survivor_stream if c.choices)
    # new requests route around it (and to its replacement once Ray has started one)
    for model in _models(cluster):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
    wait_for(lambda: len(cluster.replicas()) == 2 and victim not in cluster.replicas(), 120,
          "Ray to replace the replica")  # fmt: skip

    def everywhere() -> bool:
        reports = cluster.engine.board.snapshot()[0]
        return len(reports) == 2 and all(
            "runtime-pirate" in r["adapters"] for r in reports.values()
        )

    wait_for(everywhere, 60, "the runtime adapter on the replacement")
    replacement = next(r for r in cluster.replicas() if r != survivor)

    async def on_replacement() -> str:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        text = ""
        async for out in cluster.engine.generate(
            "Hello", params, adapter="runtime-pirate", replica=replacement
        ):
            text += out.text
        return text

    assert cluster.loop.run(on_replacement())


# -- the command line --------------------------------------------------------------------------------


def test_cli_serve_ray_joins_a_cluster_and_serves(cluster: Cluster, tmp_path):
    """``loraplex serve-ray --ray-address`` (runs last: it redeploys the app)."""
    log = open(tmp_path / "serve-ray.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.engine.server.cli", "serve-ray", *FLAGS,
         "--replicas", "1", "--ray-address", cluster.gcs_address, "--port", "0", "--log-json"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        url = None
        deadline = time.monotonic() + 240
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            for line in (tmp_path / "serve-ray.log").read_text().splitlines():
                if '"serving"' in line:
                    url = json.loads(line)["url"]
            time.sleep(0.5)
        assert url, (tmp_path / "serve-ray.log").read_text()[-3000:]
        reply = cluster.client(url).completions.create(model="pirate", prompt=PROMPT, max_tokens=5)
        ref = cluster.client(cluster.reference_url).completions.create(
            model="pirate", prompt=PROMPT, max_tokens=5
        )
        assert reply.choices[0].text == ref.choices[0].text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    assert proc.returncode == 0, (tmp_path / "serve-ray.log").read_text()[-3000:]


def test_cli_help_lists_serve_flags_and_ray_flags():
    out = subprocess.run(
        [sys.executable, "-m", "loraplex.engine.server.cli", "serve-ray", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0
    for flag in ("--replicas", "--ray-address", "--host", "--port", "--lora-modules",
                 "--max-loras", "--admin-token-file", "--lora-allow", "--route-policy"):  # fmt: skip
        assert flag in out.stdout, flag
    bad = subprocess.run(
        [sys.executable, "-m", "loraplex.engine.server.cli", "serve-ray", "--replicas", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--replicas" in bad.stderr
