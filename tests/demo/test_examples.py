"""examples/embed_asyncio.py runs as a user would run it (demo model, CPU) and streams every
adapter; examples/openai_client.py at least parses its options."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from loraplex.engine.demo import demo_adapters

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_embed_asyncio_streams_every_adapter() -> None:
    cmd = [sys.executable, str(EXAMPLES / "embed_asyncio.py"), "--max-tokens", "6"]
    cmd += ["--device", "cpu", "--heartbeat", "0.05"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    names = ["base", *demo_adapters()]
    assert len(names) >= 4
    summary = out.split("streams done", 1)[1]
    for name in names:
        assert re.search(rf"^\s*{name} \| '", out, re.M), f"no streamed chunk for {name}"
        line = re.search(rf"^\s*{name} : Hello, how are you(.+)\[(length|stop)\]$", summary, re.M)
        assert line and line.group(1).strip(), f"no summary for {name}"
    assert "[heartbeat #1 " in out  # the loop ran while the model worked (no speed assert)
    assert "request_finished" not in out and "[info" not in out  # engine logs stay quiet


def test_openai_client_help() -> None:
    cmd = [sys.executable, str(EXAMPLES / "openai_client.py"), "--help"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--base-url" in proc.stdout
