"""The README runs: every code block that can run on a CPU without the network, against a demo
server of its own (``loraplex serve`` in a subprocess on 127.0.0.1, with the admin flags the
README shows), and what the README says each one gives is checked.

Blocks that need a GPU, the network, the Hub, S3 or Ray carry a ``readme-test: skip (REASON)``
marker (readme_blocks.py). Every other block must have a check below, found by a text only that
block holds, so a new block cannot go untested. docs/cli.md must name every flag of the parser.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.demo import demo_adapters
from loraplex.engine.server.cli import build_parser
from tests.demo.readme_blocks import Block, localize, parse_blocks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = parse_blocks(README.read_text(encoding="utf-8"))
OK = "README-CHECK-OK"
ENV_BIN = str(Path(sys.executable).parent)


@dataclass(frozen=True)
class Server:
    port: int
    adapters: Path
    token_file: Path


@dataclass(frozen=True)
class Check:
    key: str  # a text only its block holds
    suffix: str = ""  # python run after the block, in its namespace (asserts on its variables)
    output: Callable[[str], None] | None = None  # asserts on the block's stdout


def json_docs(text: str) -> list[Any]:
    """The JSON documents printed one after another (curl adds no newline after a body)."""
    docs, dec, i = [], json.JSONDecoder(), 0
    while (i := _skip_space(text, i)) < len(text) and text[i] in "{[":
        doc, i = dec.raw_decode(text, i)
        docs.append(doc)
    return docs


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# -- what each block gives ----------------------------------------------------------------------


def _quick_start(out: str) -> None:
    assert "usage: loraplex serve" in out and "--dry-run" in out  # loraplex serve --help
    assert out.count("[finish_reason: ") == 1 + len(demo_adapters())  # openai_client.py --chat
    assert "streams done" in out  # embed_asyncio.py


def _dry_run(out: str) -> None:
    assert "loraplex memory estimate" in out and "total " in out
    if not torch.cuda.is_available():  # the README's figures are the CPU's
        assert re.search(r"total CPU memory\s+134\.91 MiB", out), out
        assert re.search(r"weights\s+3\.75 MiB", out) and "128.00 MiB for 64 sequences" in out


def _digest(out: str) -> None:
    assert out.strip() == adapter_digest(demo_adapters()["sql"])


def _admin(out: str) -> None:
    load, completion, unload = json_docs(out)
    assert load["name"] == "sql-v2" and load["digest"] == adapter_digest(demo_adapters()["sql"])
    assert completion["model"] == "sql-v2" and completion["choices"][0]["text"].strip()
    assert "removed" in unload["message"]


def _curl_api(out: str) -> None:
    head, _, stream = out.partition("data: ")
    models, completion = json_docs(head)
    ids = {m["id"] for m in models["data"]}
    assert {"demo", *demo_adapters()} <= ids
    assert completion["model"] == "pirate" and completion["choices"][0]["text"].strip()
    chunks = [json.loads(x) for x in re.findall(r"^data: (\{.*\})$", "data: " + stream, re.M)]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks).strip()
    assert stream.rstrip().endswith("data: [DONE]")


def _client_loop(out: str) -> None:
    for name in ["demo", *demo_adapters()]:
        assert re.search(rf"^{name} -> \S", out, re.M), f"no reply from {name}"


def _health(out: str) -> None:
    status, *counts = out.strip().splitlines()
    assert status == "200" and counts
    for line in counts:  # one per adapter (and the base model)
        assert re.fullmatch(
            r'loraplex_time_to_first_token_seconds_count\{adapter="[^"]+"\} [\d.]+', line
        )


def _embedded(out: str) -> None:
    assert out.strip(), "no text streamed"
    assert "[info" not in out and '"info"' not in out  # configure_logging("warning") held


_CHOICES = """
assert len(out.choices) == 3 and all(c.message.content for c in out.choices)
assert out.choices[0].logprobs.content[0].top_logprobs
assert mixed.choices[0].text
"""
_SCHEMA = """
import json, jsonschema
assert out.choices[0].finish_reason == "stop", out.choices[0]
jsonschema.validate(json.loads(out.choices[0].message.content), schema)
"""
_TOOLS = """
import json, jsonschema
calls = out.choices[0].message.tool_calls
assert calls and len(calls) == 1, out.choices[0]
assert calls[0].function.name == "get_weather"
jsonschema.validate(json.loads(calls[0].function.arguments), weather)
"""

CHECKS = [
    Check(". .venv/bin/activate", output=_quick_start),
    Check("loraplex serve --dry-run", output=_dry_run),
    Check("loraplex digest engine/demo", output=_digest),
    Check("load_lora_adapter", output=_admin),
    Check("curl -s http://127.0.0.1:8000/v1/models", output=_curl_api),
    Check("client = OpenAI(", output=_client_loop),
    Check("n=3", suffix=_CHOICES),
    Check("response_format=", suffix=_SCHEMA),
    Check('tool_choice="required"', suffix=_TOOLS),
    Check("/health", output=_health),
    Check("AsyncEngine(", output=_embedded),
]


def _check_of(block: Block) -> Check:
    found = [c for c in CHECKS if c.key in block.code]
    assert len(found) == 1, f"README {block.id}: want one check, found {[c.key for c in found]}"
    return found[0]


# -- the server and the runs --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("readme")
    adapters = tmp / "adapters"
    shutil.copytree(demo_adapters()["sql"], adapters / "sql-v2")
    token = tmp / "admin-token"
    token.write_text("readme-s3cret\n")
    log = tmp / "serve.log"
    cmd = [sys.executable, "-m", "loraplex.engine.server.cli", "serve", "--port", "0"]
    cmd += ["--device", "cpu", "--admin-token-file", str(token), "--lora-local-root", str(adapters)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
    try:
        yield Server(_wait_serving(proc, log), adapters, token)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_serving(proc: subprocess.Popen, log: Path) -> int:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = log.read_text()
        if m := re.search(r'"url": "http://127\.0\.0\.1:(\d+)"', text):
            return int(m.group(1))
        assert proc.poll() is None, f"loraplex serve exited: {text[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"loraplex serve did not start: {log.read_text()[-3000:]}")


def _run(block: Block, server: Server, check: Check) -> subprocess.CompletedProcess[str]:
    code = localize(block.code, port=server.port, adapters=server.adapters,
                    token_file=server.token_file)  # fmt: skip
    env = {**os.environ, "PATH": ENV_BIN + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        if "client." in code and "client = " not in code:
            code = _client_setup(server.port) + code
        cmd = [sys.executable, "-c", f"{code}\n{check.suffix}\nprint({OK!r})"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _client_setup(port: int) -> str:
    """The lines of the README's first client block that make ``client``."""
    first = next(b for b in BLOCKS if b.lang == "python" and "client = OpenAI(" in b.code)
    lines = first.code.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("client = "))
    setup = "\n".join(lines[: end + 1]) + "\n"
    return localize(setup, port=port, adapters=Path(), token_file=Path())


# -- the tests ------------------------------------------------------------------------------------


def test_markers_and_checks() -> None:
    skipped = [b for b in BLOCKS if b.skip]
    assert skipped and all(b.skip and len(b.skip) > 8 for b in skipped)
    runnable = [b for b in BLOCKS if not b.skip]
    assert {b.lang for b in runnable} <= {"bash", "python"}, [b.id for b in runnable]
    for block in runnable:
        _check_of(block)
    keys = [_check_of(b).key for b in runnable]
    assert sorted(keys) == sorted(c.key for c in CHECKS)  # every check found its block


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, request: pytest.FixtureRequest) -> None:
    if block.skip:
        pytest.skip(f"README {block.id}: {block.skip}")
    check = _check_of(block)
    proc = _run(block, request.getfixturevalue("server"), check)  # started once, when needed
    said = f"README {block.id}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    if block.lang == "python":
        assert proc.stdout.rstrip().endswith(OK), said
    else:
        errors = [d for d in json_docs(proc.stdout) if isinstance(d, dict) and "error" in d]
        assert not errors, said
    if check.output is not None:
        check.output(proc.stdout.replace(OK, ""))


def test_cli_page_names_every_flag() -> None:
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for command in ("serve", "serve-ray", "digest"):
        for action in sub.choices[command]._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and f"`{flag}" not in page:
                    missing.append(f"{command} {flag}")
    assert not missing, f"docs/cli.md does not name: {missing}"


def test_relative_links_resolve() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
