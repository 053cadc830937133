"""A fake Hugging Face Hub on 127.0.0.1 (reached via HF_ENDPOINT) for base-model downloads.

Serves the endpoints huggingface_hub's ``model_info``, ``list_repo_tree``, ``hf_hub_download``
(HEAD + GET) and ``parse_safetensors_file_metadata`` (ranged GET) use, from in-memory commits.
It runs in a thread (``http.server``), so a CLI subprocess can use it while a test waits.
Repos can be gated or need a token; every request is recorded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

__all__ = [
    "FakeHub",
    "Req",
    "folder_files",
    "hub_fixture",
    "tiny_files_fixture",
    "quiet_logging_fixture",
]

_shas = itertools.count()


@dataclass(frozen=True)
class Req:
    method: str
    path: str  # unquoted, without the query
    range: str | None
    auth: str | None


@dataclass
class _Repo:
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    gated: bool = False
    token: str | None = None  # requests must carry it (else 401)


def folder_files(folder: Path, prefix: str = "") -> dict[str, bytes]:
    return {prefix + p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.requests: list[Req] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def commit(self, repo_id: str, files: dict[str, bytes], ref: str = "main", **flags) -> str:
        sha = hashlib.sha1(f"{repo_id}-{next(_shas)}".encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, _Repo())
        for k, v in flags.items():
            setattr(repo, k, v)
        repo.commits[sha], repo.refs[ref] = dict(files), sha
        return sha

    def downloads(self) -> list[str]:
        """Paths of file bodies fetched whole (GET without a Range header)."""
        return [r.path for r in self.requests if r.method == "GET" and "/resolve/" in r.path
                and r.range is None]  # fmt: skip

    def ranged(self) -> list[str]:
        return [r.path for r in self.requests if "/resolve/" in r.path and r.range is not None]


_INFO = re.compile(r"/api/models/([^/]+)/([^/]+)(?:/revision/(.+))?$")
_TREE = re.compile(r"/api/models/([^/]+)/([^/]+)/tree/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _fail(self, status: int, code: str, commit: str | None = None) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, obj: object) -> None:
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _lookup(self, org: str, name: str, rev: str) -> tuple[str, dict] | None:
            repo = hub.repos.get(f"{org}/{name}")
            if repo is None:
                self._fail(404, "RepoNotFound")
                return None
            auth = self.headers.get("Authorization")
            if repo.gated:
                self._fail(403, "GatedRepo")
                return None
            if repo.token is not None and auth != f"Bearer {repo.token}":
                self._fail(401, "RepoNotFound")
                return None
            rev = unquote(rev)
            sha = repo.refs.get(rev, rev if rev in repo.commits else None)
            if sha is None:
                self._fail(404, "RevisionNotFound")
                return None
            return sha, repo.commits[sha]

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            rng = self.headers.get("Range")
            hub.requests.append(Req(self.command, path, rng, self.headers.get("Authorization")))
            if m := _TREE.match(path):
                if (found := self._lookup(*m.groups()[:3])) is not None:
                    sha, files = found
                    under = (m.group(4) or "").strip("/")
                    self._json([
                        {"type": "file", "oid": hashlib.sha1(b).hexdigest(), "size": len(b),
                         "path": p}
                        for p, b in files.items() if not under or p.startswith(under + "/")
                    ])  # fmt: skip
            elif m := _INFO.match(path):
                if (found := self._lookup(m.group(1), m.group(2), m.group(3) or "main")) is None:
                    return
                sha, files = found
                siblings = [
                    {"rfilename": p, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
                    for p, b in files.items()
                ]
                repo_id = f"{m.group(1)}/{m.group(2)}"
                self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                            "siblings": siblings})  # fmt: skip
            elif m := _RESOLVE.match(path):
                if (found := self._lookup(*m.groups()[:3])) is None:
                    return
                sha, files = found
                data = files.get(m.group(4))
                if data is None:
                    self._fail(404, "EntryNotFound", sha)
                    return
                status, body = 200, data
                if rng and (r := re.fullmatch(r"bytes=(\d+)-(\d*)", rng)):
                    lo, hi = int(r.group(1)), int(r.group(2) or len(data) - 1)
                    status, body = 206, data[lo : hi + 1]
                self.send_response(status)
                self.send_header("X-Repo-Commit", sha)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
            else:
                self._fail(404, "NotFound")

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._serve(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(head=True)

    return Handler


# -- fixtures: a test module imports the *_fixture functions; tests name them without it --


@pytest.fixture(scope="session", name="tiny_files")
def tiny_files_fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A tiny sharded Llama with its tokenizer, plus what a download must leave behind:
    pickled weights, code, a README and Mistral-style consolidated weights in a subfolder."""
    from tests.helpers.models import make_tiny_model
    from tests.helpers.tokenizers import make_tokenizer

    folder = make_tiny_model(tmp_path_factory.mktemp("hub-model") / "tiny", seed=5, shard=True)
    make_tokenizer(folder)
    return {
        **folder_files(folder),
        "pytorch_model.bin": b"\x80\x04not loaded",
        "modeling_tiny.py": b"raise SystemExit('code from the model repo ran')\n",
        "README.md": b"# tiny\n",
        "original/consolidated.safetensors": b"not fetched",
    }


@pytest.fixture(name="hub")
def hub_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The fake Hub behind HF_ENDPOINT, with an empty HF_HOME under ``tmp_path``."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        pytest.skip("huggingface_hub was imported in offline mode")
    fake = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture(name="quiet_logging")
def quiet_logging_fixture() -> Iterator[None]:
    """For tests that run the CLI in-process: undo the logging it configures."""
    import logging

    import structlog

    yield
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == "loraplex"]:
        root.removeHandler(h)
    structlog.reset_defaults()
