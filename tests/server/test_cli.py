"""The ``loraplex`` command: help, digest, flag parsing, logging, and a real ``serve``."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.config import EngineConfig
from loraplex.engine.server.cli import build_parser
from loraplex.engine.server.launch import LoraModule, config_from_args, parse_lora_module

CLI = [sys.executable, "-m", "loraplex.engine.server.cli"]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_commands_and_serve_flags():
    top = _run("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "digest" in top.stdout
    serve = _run("serve", "--help")
    assert serve.returncode == 0
    for flag in (
        "--host", "--port", "--device", "--dtype", "--served-model-name", "--lora-modules",
        "--max-loras", "--max-cpu-loras", "--max-lora-rank", "--admin-token-file",
        "--lora-allow", "--lora-local-root", "--plugins", "--max-num-seqs", "--max-model-len",
        "--log-level", "--log-json", "--max-request-body-bytes", "--max-json-depth",
        "--max-prompt-chars", "--max-prompts-times-n", "--max-stop-strings",
        "--max-stop-string-chars", "--header-timeout", "--body-timeout", "--keep-alive-timeout",
        "--shutdown-timeout", "--tensor-parallel-size",
    ):  # fmt: skip
        assert flag in serve.stdout, flag
    if shutil.which("loraplex"):  # the installed console script
        assert subprocess.run(["loraplex", "--help"], capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
def test_digest_equals_sha256sum_pipeline(tiny):
    folder = tiny.adapters["sql"]
    expected = subprocess.run(
        "sha256sum adapter_config.json adapter_model.safetensors | sha256sum",
        shell=True,
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[0]
    out = _run("digest", str(folder))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected == adapter_digest(folder)
    assert _run("digest", f"file://{folder}").stdout.strip() == expected
    missing = _run("digest", str(folder / "nope"))
    assert missing.returncode == 1 and "nope" in missing.stderr


def test_lora_modules_forms():
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", "/a/b")
    assert parse_lora_module("hub=hf://org/repo@main") == LoraModule("hub", "hf://org/repo@main")
    sha = "AB" * 32
    js = json.dumps({"name": "x", "uri": "s3://b/p", "sha256": f"sha256:{sha}"})
    assert parse_lora_module(js) == LoraModule("x", "s3://b/p", sha.lower())
    for bad in ("noequals", "=uri", '{"name": 1}', "{bad json"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_flags_map_onto_engine_config(tmp_path):
    args = build_parser().parse_args(
        [
            "serve", str(tmp_path), "--device", "cpu", "--dtype", "float32",
            "--served-model-name", "m", "--lora-modules", "a=/x", "b=/y",
            "--lora-modules", '{"name": "c", "uri": "/z"}', "--max-loras", "3",
            "--max-cpu-loras", "5", "--max-lora-rank", "32", "--max-num-seqs", "7",
            "--max-model-len", "256", "--lora-allow", "hf://org/*", "--lora-allow", "s3://b/*",
            "--lora-local-root", str(tmp_path), "--plugins", "local,s3",
        ]
    )  # fmt: skip
    assert [m.name for m in args.lora_modules] == ["a", "b", "c"]
    cfg = config_from_args(args)
    assert (cfg.model, cfg.device, cfg.dtype, cfg.served_model_name) == (
        str(tmp_path), "cpu", "float32", "m"
    )  # fmt: skip
    assert (cfg.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank) == (3, 5, 32)
    assert (cfg.max_num_seqs, cfg.max_model_len) == (7, 256)
    assert cfg.allow_sources == ("hf://org/*", "s3://b/*")
    assert cfg.local_roots == (str(tmp_path.resolve()),)
    assert cfg.enabled_plugins == ("local", "s3")
    demo = config_from_args(build_parser().parse_args(["serve"]))
    assert demo.model is None and demo.served_model_name == "demo"
    assert demo.enabled_plugins is None
    assert demo.cuda_graphs and demo.async_scheduling
    eager = config_from_args(
        build_parser().parse_args(["serve", "--enforce-eager", "--no-async-scheduling"])
    )
    assert not eager.cuda_graphs and not eager.async_scheduling
    loads = config_from_args(
        build_parser().parse_args(
            [
                "serve", "--loader-processes", "3", "--max-concurrent-loads", "6",
                "--adapter-cache-dir", str(tmp_path), "--adapter-cache-bytes", "1000",
                "--mixed-graph-tokens", "0",
            ]
        )
    )  # fmt: skip
    assert (loads.loader_processes, loads.max_concurrent_loads) == (3, 6)
    assert (loads.adapter_cache_dir, loads.adapter_cache_bytes) == (str(tmp_path), 1000)
    assert loads.mixed_graph_tokens == 0
    assert demo.loader_processes is None and demo.mixed_graph_tokens == 256
    assert demo.tensor_parallel_size == 1
    assert demo.max_full_module_loras == 0  # adapters with full tables refused
    args = ["serve", "--max-loras", "4", "--max-full-module-loras", "2"]
    full = config_from_args(build_parser().parse_args(args))
    assert (full.max_loras, full.max_full_module_loras) == (4, 2)
    assert demo.max_expert_loras is None and demo.expert_slots == demo.max_loras  # every slot
    args = ["serve", "--max-loras", "4", "--max-expert-loras", "1"]
    experts = config_from_args(build_parser().parse_args(args))
    assert (experts.max_expert_loras, experts.expert_slots) == (1, 1)
    with pytest.raises(ValueError, match="max_expert_loras must be between 0 and max_loras"):
        config_from_args(
            build_parser().parse_args(["serve", *args[1:3], "--max-expert-loras", "5"])
        )
    tp = config_from_args(build_parser().parse_args(["serve", "--tensor-parallel-size", "2"]))
    assert tp.tensor_parallel_size == 2
    ray = build_parser().parse_args(["serve-ray", "--tensor-parallel-size", "2"])
    assert config_from_args(ray).tensor_parallel_size == 2  # serve-ray passes serve flags on
    sizes = ["serve", "--max-num-seqs", "32", "--cuda-graph-sizes", "32", "8", "8"]
    assert config_from_args(build_parser().parse_args(sizes)).cuda_graph_sizes == (8, 32)
    assert demo.cuda_graph_sizes is None  # the default buckets up to --max-num-seqs
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        config_from_args(build_parser().parse_args(sizes[:3] + ["--cuda-graph-sizes", "64"]))
    for bad in [(), (0, 4), (4.0,), ("4",)]:
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig(cuda_graph_sizes=bad)  # type: ignore[arg-type]


def test_adapter_eviction_flag(capsys):
    from loraplex.engine.config import ADAPTER_EVICTIONS
    from loraplex.engine.server import launch

    assert launch.ADAPTER_EVICTIONS == ADAPTER_EVICTIONS  # the parser's choices: the config's
    assert config_from_args(build_parser().parse_args(["serve"])).adapter_eviction == "lru"
    for command in ("serve", "serve-ray"):  # serve-ray passes serve flags on
        args = build_parser().parse_args([command, "--adapter-eviction", "gdf"])
        assert config_from_args(args).adapter_eviction == "gdf"
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--adapter-eviction", "arc"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--adapter-eviction" in err and "'arc'" in err and "gdf" in err


def test_serve_ray_refuses_adapters_that_add_tokens():
    from loraplex.engine.serve_ray.launch import run

    # (its ingress encodes prompts with the base tokenizer: a configuration error, exit 2)
    flags = ["--max-full-module-loras", "1", "--lora-extra-vocab-size", "4"]
    assert run(build_parser().parse_args(["serve-ray", *flags])) == 2


def test_limit_flags_map_onto_server_limits():
    from loraplex.engine.server.limits import ServerLimits, limits_from_args

    assert limits_from_args(build_parser().parse_args(["serve"])) == ServerLimits()
    args = build_parser().parse_args(
        ["serve", "--max-prompt-chars", "9", "--shutdown-timeout", "2.5", "--max-stop-strings", "3"]
    )
    limits = limits_from_args(args)
    assert (limits.max_prompt_chars, limits.shutdown_timeout, limits.max_stop_strings) == (
        9,
        2.5,
        3,
    )


def test_serve_refuses_bad_lora_module_names_before_loading():
    dup = _run("serve", "--device", "cpu", "--lora-modules", "a=/x", "a=/y")
    assert dup.returncode == 2 and "'a'" in dup.stderr, dup.stderr
    base = _run("serve", "--device", "cpu", "--lora-modules", "demo=/x")
    assert base.returncode == 2 and "'demo'" in base.stderr, base.stderr
    escape = _run("serve", "--device", "cpu", "--lora-modules", "../../x=/x")
    assert escape.returncode == 2 and "bad adapter name" in escape.stderr, escape.stderr


def test_configure_logging_json_lines():
    code = (
        "import logging, structlog\n"
        "from loraplex.engine.logging import configure_logging\n"
        "configure_logging('info', json=True)\n"
        "structlog.get_logger('loraplex.test').info('hello', answer=42)\n"
        "structlog.get_logger('loraplex.test').debug('hidden')\n"
        "logging.getLogger('aiohttp.server').warning('from stdlib')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [(r["event"], r["level"]) for r in lines] == [
        ("hello", "info"),
        ("from stdlib", "warning"),
    ]
    assert lines[0]["answer"] == 42 and "timestamp" in lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read()


def test_serve_starts_registers_modules_and_stops_on_sigint(tiny, tmp_path):
    port = _free_port()
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    sha = adapter_digest(tiny.adapters["poem"])
    proc = subprocess.Popen(
        [
            *CLI, "serve", str(tiny.model_dir), "--port", str(port), "--device", "cpu",
            "--dtype", "float32", "--served-model-name", "tiny", "--max-loras", "2",
            "--lora-modules", f"sql={tiny.adapters['sql']}",
            json.dumps({"name": "poem", "uri": str(tiny.adapters["poem"]), "sha256": sha}),
            "--admin-token-file", str(token), "--log-json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        models = json.loads(_get(f"http://127.0.0.1:{port}/v1/models")[1])
        assert [m["id"] for m in models["data"]] == ["tiny", "sql", "poem"]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/load_lora_adapter", data=b"{}")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401  # admin routes exist with --admin-token-file
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    events = [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]
    assert "capacity_report" in events and "serving" in events
