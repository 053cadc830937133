"""Where the engine loads the study's adapters from, always by name (dynamic loading):

- ``local``: ``lora_name_template="file:///<root>/{name}"`` with the root in ``local_roots``;
- ``s3``: a local moto S3 server, ``s3://coldload/<set>/{name}`` plus an allow pattern;
- ``hub``: a local fake Hub (``HF_ENDPOINT``), ``hf://<org>/{name}`` plus an allow pattern.

Servers start once and serve every adapter set of the study; ``SourcePool.close`` stops them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.bench.coldload.adapters import AdapterSet
from loraplex.engine.bench.coldload.servers import HubServer, S3Server

__all__ = ["Source", "SourcePool", "environment"]

BUCKET = "coldload"


@dataclass
class Source:
    kind: str
    engine_kwargs: dict[str, Any]  # EngineConfig fields: template, roots, allow patterns
    env: dict[str, str] = field(default_factory=dict)  # what the resolver reads at fetch time
    uploaded_bytes: int = 0


class SourcePool:
    """Starts servers lazily and publishes each adapter set once per source kind."""

    def __init__(self) -> None:
        self._s3: S3Server | None = None
        self._hub: HubServer | None = None
        self._sources: dict[tuple[str, str], Source] = {}
        self._sets: dict[str, int] = {}  # adapter-set root -> index (bucket prefix / hub org)

    def get(self, kind: str, aset: AdapterSet) -> Source:
        key = (kind, str(aset.root))
        if key not in self._sources:
            self._sources[key] = self._make(kind, aset)
        return self._sources[key]

    def _make(self, kind: str, aset: AdapterSet) -> Source:
        idx = self._sets.setdefault(str(aset.root), len(self._sets))
        if kind == "local":
            root = aset.root.resolve()
            return Source(
                kind,
                {"lora_name_template": f"{root.as_uri()}/{{name}}", "local_roots": (str(root),)},
            )
        folders = [(n, aset.folder(n)) for n in aset.names]
        if kind == "s3":
            if self._s3 is None:
                self._s3 = S3Server()
            prefix = f"set{idx}"
            sent = self._s3.upload(BUCKET, prefix, folders)
            kwargs = {
                "lora_name_template": f"s3://{BUCKET}/{prefix}/{{name}}",
                "allow_sources": (f"s3://{BUCKET}/{prefix}/*",),
            }
            return Source(kind, kwargs, dict(self._s3.env), sent)
        if kind == "hub":
            if self._hub is None:
                self._hub = HubServer()
            org = f"coldload{idx}"
            for name, folder in folders:
                self._hub.add_repo(f"{org}/{name}", folder)
            kwargs = {
                "lora_name_template": f"hf://{org}/{{name}}",
                "allow_sources": (f"hf://{org}/*",),
            }
            return Source(kind, kwargs, dict(self._hub.env))
        raise ValueError(f"unknown source {kind!r}")

    def close(self) -> None:
        for server in (self._s3, self._hub):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        self._s3 = self._hub = None
        self._sources.clear()


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block, restoring the previous values after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
