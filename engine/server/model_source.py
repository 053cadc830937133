"""Where ``loraplex serve MODEL`` finds its base model, and the flags that say so.

MODEL (positional, or ``--model MODEL`` as in vLLM) is one of:

- nothing: the built-in demo model;
- a local folder (``file://`` optional): a path that exists always wins, ``./org/name`` too;
- ``ORG/NAME[@REVISION]`` or ``hf://org/repo[/subdir][@revision]``: a Hugging Face Hub model,
  downloaded into the Hub cache (``model_hub.py``); ``--revision REV`` is the same as ``@REV``;
- ``s3://bucket/prefix``: a model folder on S3 (``model_s3.py``).

``--download-dir DIR`` puts remote models under DIR instead of the Hugging Face cache. Only
config.json, the generation, tokenizer and chat-template files and the safetensors weights
come down (``model_files.py``); nothing from the folder is ever imported or run.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from loraplex.engine.server.model_files import (
    ModelMetadata,
    ModelNotFoundError,
    ModelSourceError,
    local_metadata,
)

if TYPE_CHECKING:
    from loraplex.engine.config import EngineConfig

__all__ = [
    "ModelSource",
    "parse_model_source",
    "resolve_model",
    "resolve_config_model",
    "model_metadata",
    "add_model_arguments",
    "model_arg",
]

# ORG/NAME with an optional @REVISION (a revision may hold slashes: refs/pr/1)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@.+)?")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # demo | local | hf | s3
    text: str | None  # as given
    path: Path | None = None  # local
    repo_id: str = ""  # hf: org/repo
    subdir: str = ""  # hf: a folder inside the repo
    revision: str = "main"  # hf: branch, tag or commit
    bucket: str = ""  # s3
    prefix: str = ""  # s3

    @property
    def served_name(self) -> str | None:
        """The API's default name for the base model (None: the engine's own default)."""
        if self.kind == "hf":
            return f"{self.repo_id}/{self.subdir}" if self.subdir else self.repo_id
        if self.kind == "s3":
            return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        return None


def parse_model_source(text: str | None, revision: str | None = None) -> ModelSource:
    """Classify MODEL (see the module docstring); ModelSourceError when it is none of them or
    ``revision`` contradicts it."""
    if text is None or text == "":
        if revision:
            raise ModelSourceError("--revision needs a Hub model (ORG/NAME or hf://...)")
        return ModelSource("demo", None)
    remote = text.startswith(("hf://", "s3://"))
    local = Path(text.removeprefix("file://")).expanduser()
    if not remote and (local.exists() or not _HUB_ID.fullmatch(text)):
        if revision:
            raise ModelSourceError(f"--revision {revision!r} applies to Hub models, not {text!r}")
        if not local.exists():
            raise ModelNotFoundError(
                f"no model folder {text!r} (nor is it a Hub id ORG/NAME[@REVISION], "
                "hf://org/repo or s3://bucket/prefix)"
            )
        return ModelSource("local", text, path=local)
    if text.startswith("s3://"):
        from loraplex.engine.errors import AdapterSourceError
        from loraplex.resolvers.s3 import parse_s3_uri

        if revision:
            raise ModelSourceError(f"--revision {revision!r} applies to Hub models, not {text!r}")
        try:
            bucket, prefix = parse_s3_uri(text)
        except AdapterSourceError as e:
            raise ModelSourceError(str(e)) from None
        return ModelSource("s3", text, bucket=bucket, prefix=prefix)
    from loraplex.engine.errors import AdapterSourceError
    from loraplex.resolvers.huggingface import parse_hf_uri

    uri = text if text.startswith("hf://") else f"hf://{text}"
    try:
        hf = parse_hf_uri(uri)
    except AdapterSourceError as e:
        raise ModelSourceError(str(e)) from None
    if revision and "@" in uri and revision != hf.revision:
        raise ModelSourceError(
            f"{text!r} names revision {hf.revision!r} but --revision {revision!r}"
        )
    return ModelSource(
        "hf", text, repo_id=hf.repo_id, subdir=hf.subdir, revision=revision or hf.revision
    )


@contextlib.contextmanager
def _no_folder_either(source: ModelSource) -> Iterator[None]:
    """A Hub id not found says there is no such local folder either (a mistyped path)."""
    try:
        yield
    except ModelNotFoundError as e:
        if (source.text or "").startswith("hf://"):
            raise
        raise ModelNotFoundError(f"{e} (and there is no local folder {source.text!r})") from e


def resolve_model(
    source: ModelSource, *, download_dir: str | None = None, bars: bool | None = None
) -> Path | None:
    """The local folder to serve (None: the demo), downloading a remote model if needed.
    ``bars``: progress bars (default: when stderr is a TTY), else log lines."""
    if bars is None:
        bars = sys.stderr.isatty()
    if source.kind == "hf":
        from loraplex.engine.server.model_hub import fetch_hub_model

        with _no_folder_either(source):
            return fetch_hub_model(
                source.repo_id, source.subdir, source.revision, download_dir=download_dir, bars=bars
            )
    if source.kind == "s3":
        from loraplex.engine.server.model_s3 import fetch_s3_model

        return fetch_s3_model(source.bucket, source.prefix, download_dir=download_dir, bars=bars)
    return source.path


def resolve_config_model(
    config: EngineConfig,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    bars: bool | None = None,
) -> EngineConfig:
    """``config`` with its model named by a local folder: a remote one is downloaded, and it
    is served under its Hub id (or S3 URI) unless ``served_model_name`` is set."""
    source = parse_model_source(config.model, revision)
    if source.kind in ("demo", "local") and not (config.model or "").startswith("file://"):
        return config
    folder = resolve_model(source, download_dir=download_dir, bars=bars)
    name = config.served_model_name or source.served_name
    return replace(config, model=str(folder), served_model_name=name)


def model_metadata(
    config: EngineConfig, *, revision: str | None = None, download_dir: str | None = None
) -> ModelMetadata:
    """config.json and the weight headers of ``config``'s model, without downloading the
    weights of a remote one (``--dry-run``)."""
    source = parse_model_source(config.model, revision)
    if source.kind == "hf":
        from loraplex.engine.server.model_hub import hub_metadata

        with _no_folder_either(source):
            return hub_metadata(
                source.repo_id, source.subdir, source.revision, download_dir=download_dir
            )
    if source.kind == "s3":
        from loraplex.engine.server.model_s3 import s3_metadata

        return s3_metadata(source.bucket, source.prefix)
    if source.kind == "demo":
        from loraplex.engine.demo import demo_model_dir

        return local_metadata(demo_model_dir())
    assert source.path is not None
    return local_metadata(source.path)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, ``--model``, ``--revision`` and ``--download-dir``."""
    p.add_argument(
        "model", nargs="?", metavar="MODEL",
        help="model folder, Hub id ORG/NAME[@REVISION], hf://org/repo[/subdir][@rev] or "
        "s3://bucket/prefix (default: the built-in demo model)",
    )  # fmt: skip
    p.add_argument(
        "--model", dest="model_flag", metavar="MODEL", help="the same as the positional MODEL"
    )
    p.add_argument(
        "--revision", metavar="REV", help="branch, tag or commit of a Hub model (as MODEL@REV)"
    )
    p.add_argument(
        "--download-dir", metavar="DIR",
        help="where Hub and S3 models are downloaded (default: the Hugging Face cache, "
        "HF_HUB_CACHE or $HF_HOME/hub)",
    )  # fmt: skip


def model_arg(args: argparse.Namespace) -> str | None:
    """MODEL from the positional or ``--model``; ValueError when both differ."""
    pos, flag = getattr(args, "model", None), getattr(args, "model_flag", None)
    if pos and flag and pos != flag:
        raise ValueError(f"two models given: {pos!r} and --model {flag!r}")
    return pos or flag
