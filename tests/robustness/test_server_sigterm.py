"""``loraplex serve`` on SIGTERM: stops listening, lets running requests finish up to
``--shutdown-timeout``, aborts the rest with finish_reason "abort" and says why, exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

CLI = [sys.executable, "-m", "loraplex.engine.server.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


def _stream(url: str, events: list[dict], first: threading.Event) -> None:
    body = {"model": "demo", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                first.set()


def test_sigterm_drains_then_aborts():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*CLI, "serve", "--device", "cpu", "--port", str(port), "--shutdown-timeout", "1",
         "--log-json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_up(proc, url)
        events: list[dict] = []
        first = threading.Event()
        t = threading.Thread(target=_stream, args=(url, events, first))
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert not t.is_alive()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    assert finishes[-1] == "abort", events[-3:]
    assert events[-1]["error"]["code"] == 503 and "--shutdown-timeout" in events[-1]["error"][
        "message"]  # fmt: skip
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    names = [r["event"] for r in logs]
    assert "shutting_down" in names and "shutdown_aborted_requests" in names, names
