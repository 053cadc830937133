"""Base models from a folder, the Hugging Face Hub (a fake one on 127.0.0.1) and S3 (moto)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from loraplex.engine.server.model_files import (
    ModelAccessError,
    ModelFormatError,
    ModelNetworkError,
    ModelNotFoundError,
    ModelOfflineError,
    ModelSourceError,
    plan_files,
)
from loraplex.engine.server.model_hub import fetch_hub_model
from loraplex.engine.server.model_source import model_arg, parse_model_source
from tests.server.fake_hub import (  # noqa: F401 - fixtures
    FakeHub,
    hub_fixture,
    quiet_logging_fixture,
    tiny_files_fixture,
)

CLI = [sys.executable, "-m", "loraplex.engine.server.cli"]
SERVED = [
    "config.json", "generation_config.json", "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
]  # fmt: skip


# -- which MODEL is which ---------------------------------------------------------------------


def test_parse_model_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_model_source(None).kind == "demo"
    hf = parse_model_source("meta-llama/Llama-3.1-8B-Instruct")
    assert (hf.kind, hf.repo_id, hf.revision, hf.served_name) == (
        "hf", "meta-llama/Llama-3.1-8B-Instruct", "main", "meta-llama/Llama-3.1-8B-Instruct"
    )  # fmt: skip
    assert parse_model_source("org/name@v1.0").revision == "v1.0"
    assert parse_model_source("org/name", "refs/pr/1").revision == "refs/pr/1"
    sub = parse_model_source("hf://org/repo/sub/dir@abc")
    assert (sub.repo_id, sub.subdir, sub.revision, sub.served_name) == (
        "org/repo", "sub/dir", "abc", "org/repo/sub/dir"
    )  # fmt: skip
    s3 = parse_model_source("s3://bucket/models/tiny/")
    assert (s3.kind, s3.bucket, s3.prefix, s3.served_name) == (
        "s3", "bucket", "models/tiny", "s3://bucket/models/tiny"
    )  # fmt: skip
    (tmp_path / "org" / "name").mkdir(parents=True)  # a folder that exists wins over a Hub id
    for text in ("org/name", "./org/name", f"file://{tmp_path}/org/name"):
        local = parse_model_source(text)
        assert local.kind == "local" and local.path is not None and local.path.is_dir(), text
    with pytest.raises(ModelNotFoundError, match="no model folder"):
        parse_model_source("./missing")
    with pytest.raises(ModelNotFoundError, match="no model folder"):
        parse_model_source("/no/such/dir")
    for bad in ("hf://repo", "hf://org/re po", "s3://B/x"):
        with pytest.raises(ModelSourceError):
            parse_model_source(bad)
    with pytest.raises(ModelSourceError, match="--revision"):
        parse_model_source("org/name@v1", "v2")
    with pytest.raises(ModelSourceError, match="--revision"):
        parse_model_source("./org/name", "v2")
    with pytest.raises(ModelSourceError, match="--revision"):
        parse_model_source(None, "v2")
    assert parse_model_source("org/name@v2", "v2").revision == "v2"


def test_model_flag_and_positional() -> None:
    from loraplex.engine.server.cli import build_parser

    parse = build_parser().parse_args
    assert model_arg(parse(["serve", "--model", "org/a"])) == "org/a"
    assert model_arg(parse(["serve", "org/a"])) == "org/a"
    assert model_arg(parse(["serve", "org/a", "--model", "org/a"])) == "org/a"
    with pytest.raises(ValueError, match="two models"):
        model_arg(parse(["serve", "org/a", "--model", "org/b"]))
    assert model_arg(parse(["serve"])) is None
    args = parse(["serve", "--model", "org/a", "--download-dir", "/d", "--revision", "r"])
    assert (args.download_dir, args.revision) == ("/d", "r")


def test_plan_files() -> None:
    index = {"weight_map": {"a": "s-1.safetensors", "b": "s-2.safetensors"}}
    names = {"config.json", "tokenizer.json", "model.safetensors.index.json", "s-1.safetensors",
             "s-2.safetensors", "consolidated.safetensors", "pytorch_model.bin", "x.py"}  # fmt: skip
    assert plan_files(names, lambda: index, "m") == [
        "config.json", "tokenizer.json", "model.safetensors.index.json", "s-1.safetensors",
        "s-2.safetensors",
    ]  # fmt: skip
    single = {"config.json", "model.safetensors", "consolidated.safetensors", "extra.safetensors"}
    assert plan_files(single, dict, "m") == ["config.json", "model.safetensors"]
    with pytest.raises(ModelFormatError, match="only safetensors checkpoints are served"):
        plan_files({"config.json", "pytorch_model.bin"}, dict, "m")
    with pytest.raises(ModelFormatError, match="no config.json"):
        plan_files({"model.safetensors"}, dict, "m")
    for bad in (
        {"weight_map": {"a": "../x.safetensors"}},
        {"weight_map": {"a": "gone.safetensors"}},
    ):
        with pytest.raises(ModelFormatError):
            plan_files({"config.json", "model.safetensors.index.json"}, lambda b=bad: b, "m")


# -- the Hub ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bars", [False, True])
def test_hub_download_fetches_only_what_the_engine_reads(
    hub: FakeHub, tiny_files: dict[str, bytes], tmp_path: Path, bars: bool
) -> None:
    sha = hub.commit("org/tiny", tiny_files)
    folder = fetch_hub_model("org/tiny", "", "main", download_dir=None, bars=bars)
    cache = tmp_path / "hf-home" / "hub" / "models--org--tiny"  # HF_HOME honoured
    assert folder == cache / "snapshots" / sha
    assert sorted(p.name for p in folder.iterdir()) == SERVED
    assert all((folder / n).read_bytes() == tiny_files[n] for n in SERVED)
    fetched = {p.rsplit("/", 1)[-1] for p in hub.downloads()}
    assert fetched == set(SERVED)  # never the .bin, the code, the README or original/
    assert all(f"/resolve/{sha}/" in p for p in hub.downloads())  # pinned to the commit
    assert {r.auth for r in hub.requests} == {"Bearer hf_test_token"}  # HF_TOKEN
    assert (cache / "refs" / "main").read_text() == sha


def test_revision_and_offline_cache(
    hub: FakeHub, tiny_files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    old = {**tiny_files, "config.json": tiny_files["config.json"].replace(b"{", b'{"x": 1,', 1)}
    sha_old = hub.commit("org/tiny", old, ref="v1")
    sha_new = hub.commit("org/tiny", tiny_files)
    v1 = fetch_hub_model("org/tiny", "", "v1", download_dir=None, bars=False)
    assert v1.name == sha_old and json.loads((v1 / "config.json").read_text())["x"] == 1
    by_sha = fetch_hub_model("org/tiny", "", sha_old, download_dir=None, bars=False)
    assert by_sha == v1
    main = fetch_hub_model("org/tiny", "", "main", download_dir=None, bars=False)
    assert main.name == sha_new and "x" not in json.loads((main / "config.json").read_text())

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = len(hub.requests)
    assert fetch_hub_model("org/tiny", "", "v1", download_dir=None, bars=False) == v1
    assert fetch_hub_model("org/tiny", "", "main", download_dir=None, bars=False) == main
    assert len(hub.requests) == seen  # offline: not one request
    with pytest.raises(ModelOfflineError, match="HF_HUB_OFFLINE"):
        fetch_hub_model("org/other", "", "main", download_dir=None, bars=False)
    with pytest.raises(ModelOfflineError):  # a revision never downloaded
        fetch_hub_model("org/tiny", "", "v2", download_dir=None, bars=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")

    # --download-dir replaces the cache; an unreachable Hub falls back to a complete snapshot
    there = fetch_hub_model("org/tiny", "", "main", download_dir=str(tmp_path / "dl"), bars=False)
    assert there.is_relative_to(tmp_path / "dl")
    hub.stop()
    assert fetch_hub_model("org/tiny", "", "main", download_dir=None, bars=False) == main
    with pytest.raises(ModelNetworkError, match="cannot reach the Hub"):
        fetch_hub_model("org/other", "", "main", download_dir=None, bars=False)


def test_hub_errors_are_typed(hub: FakeHub, tiny_files: dict[str, bytes]) -> None:
    with pytest.raises(ModelNotFoundError, match="'org/absent'.*not found"):
        fetch_hub_model("org/absent", "", "main", download_dir=None, bars=False)
    hub.commit("org/tiny", tiny_files)
    with pytest.raises(ModelNotFoundError, match="revision 'nope'"):
        fetch_hub_model("org/tiny", "", "nope", download_dir=None, bars=False)
    hub.commit("org/gated", tiny_files, gated=True)
    with pytest.raises(ModelAccessError, match="gated.*HF_TOKEN"):
        fetch_hub_model("org/gated", "", "main", download_dir=None, bars=False)
    hub.commit("org/private", tiny_files, token="another")
    with pytest.raises(ModelAccessError, match="401.*HF_TOKEN"):
        fetch_hub_model("org/private", "", "main", download_dir=None, bars=False)
    pickled = {k: v for k, v in tiny_files.items() if not k.startswith("model")}
    hub.commit("org/pickled", pickled)
    with pytest.raises(ModelFormatError, match="only safetensors checkpoints are served"):
        fetch_hub_model("org/pickled", "", "main", download_dir=None, bars=False)
    assert not [p for p in hub.downloads() if "pickled" in p]  # refused before any download
    hub.commit("org/multi", {f"base/{k}": v for k, v in tiny_files.items()})
    folder = fetch_hub_model("org/multi", "base", "main", download_dir=None, bars=False)
    assert folder.name == "base" and sorted(p.name for p in folder.iterdir()) == SERVED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_cli_serves_a_hub_model(hub: FakeHub, tiny_files: dict[str, bytes], tmp_path: Path) -> None:
    sha = hub.commit("org/tiny", tiny_files)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [*CLI, "serve", "org/tiny", "--port", str(port), "--device", "cpu", "--dtype",
         "float32", "--max-loras", "1", "--log-json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.3)
        models = _http(f"http://127.0.0.1:{port}/v1/models")
        assert [m["id"] for m in models["data"]] == ["org/tiny"]
        out = _http(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": "org/tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0},
        )
        assert out["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "model_download_done" in names and "serving" in names
    estimate = next(e for e in events if e["event"] == "memory_estimate")
    assert estimate["model"] == "org/tiny" and estimate["total_bytes"] > estimate["kv_bytes"] > 0
    snapshot = tmp_path / "hf-home" / "hub" / "models--org--tiny" / "snapshots" / sha
    assert sorted(p.name for p in snapshot.iterdir()) == SERVED


def test_cli_missing_repo_is_one_clear_error(hub: FakeHub) -> None:
    out = subprocess.run(
        [*CLI, "serve", "org/absent", "--device", "cpu", "--log-json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    line = json.loads(out.stderr.strip().splitlines()[-1])
    assert line["event"] == "model_unavailable" and line["kind"] == "ModelNotFoundError"
    assert "'org/absent'" in line["error"] and "not found" in line["error"]
    assert "no local folder 'org/absent'" in line["error"]  # a mistyped path would say so
    two = subprocess.run(
        [*CLI, "serve", "org/a", "--model", "org/b", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert two.returncode == 2 and "two models" in two.stderr


# -- S3 ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> object:
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_model(
    s3_endpoint: str, tiny_files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> tuple[object, str]:
    """A bucket holding the tiny model (and pickles, code, a README) under models/tiny/."""
    import boto3

    for k, v in {
        "AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
    }.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket = f"models-{os.getpid()}-{time.monotonic_ns()}"
    s3.create_bucket(Bucket=bucket)
    for name, data in tiny_files.items():
        s3.put_object(Bucket=bucket, Key=f"models/tiny/{name}", Body=data)
    return s3, bucket


async def test_s3_model_downloads_and_serves(
    s3_model: tuple, tiny_files: dict[str, bytes], tmp_path: Path
) -> None:
    import asyncio

    from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
    from loraplex.engine.server.model_files import local_metadata
    from loraplex.engine.server.model_s3 import fetch_s3_model, s3_metadata

    s3, bucket = s3_model

    def get() -> Path:
        return fetch_s3_model(bucket, "models/tiny", download_dir=str(tmp_path / "dl"), bars=False)

    folder = await asyncio.to_thread(get)
    assert folder == tmp_path / "dl" / "s3" / bucket / "models" / "tiny"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == SERVED
    stamps = {n: (folder / n).stat().st_mtime_ns for n in SERVED}
    assert await asyncio.to_thread(get) == folder  # unchanged objects are not fetched again
    assert {n: (folder / n).stat().st_mtime_ns for n in SERVED} == stamps
    changed = tiny_files["generation_config.json"].replace(b"{", b'{"x": 2,', 1)
    s3.put_object(Bucket=bucket, Key="models/tiny/generation_config.json", Body=changed)
    await asyncio.to_thread(get)
    assert (folder / "generation_config.json").read_bytes() == changed  # a new ETag: fetched

    remote = await asyncio.to_thread(s3_metadata, bucket, "models/tiny")
    assert remote.tensors == local_metadata(folder).tensors and remote.files == 3
    with pytest.raises(ModelNotFoundError):
        await asyncio.to_thread(fetch_s3_model, bucket, "models/absent", download_dir=None,
                                bars=False)  # fmt: skip

    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_loras=1,
                          max_cpu_loras=1, kv_cache_bytes=4 << 20)  # fmt: skip
    async with AsyncEngine(config) as engine:
        outs = [o async for o in engine.generate("hello", SamplingParams(max_tokens=2))]
    assert outs and outs[-1].finished


def test_cli_s3_dry_run_downloads_nothing(
    s3_model: tuple, tmp_path: Path, capsys: pytest.CaptureFixture, quiet_logging: None
) -> None:
    from loraplex.engine.server.cli import main

    _, bucket = s3_model
    dl = tmp_path / "dl"
    uri = f"s3://{bucket}/models/tiny"
    assert main(["serve", uri, "--dry-run", "--device", "cpu", "--download-dir", str(dl)]) == 0
    table = capsys.readouterr().out
    assert uri in table and "KV cache per token" in table
    assert not dl.exists()
    assert main(["serve", f"s3://{bucket}/nothing", "--dry-run", "--device", "cpu"]) == 2


def test_argparse_namespace_without_new_flags() -> None:
    # serve-ray and callers building a Namespace themselves: model_arg reads what is there
    assert model_arg(argparse.Namespace(model="x")) == "x"
