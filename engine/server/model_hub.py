"""Base models from the Hugging Face Hub: ``ORG/NAME[@REVISION]``, ``hf://org/repo[/subdir][@rev]``.

The revision (default ``main``) is resolved to its commit once (``model_info``); the files the
engine reads (``model_files.plan_files``) are then downloaded at that commit into the standard
Hub cache (HF_HUB_CACHE, else ``$HF_HOME/hub``; ``--download-dir`` replaces it), and the branch
or tag is recorded under ``refs/`` so that offline start-ups find the snapshot. HF_ENDPOINT and
HF_TOKEN are read when the fetch starts. Offline (HF_HUB_OFFLINE), or when the Hub cannot be
reached, a complete cached snapshot is served; otherwise a typed error says why.

Progress: huggingface_hub's bars on a TTY (``progress="bars"``), log lines otherwise.
The memory estimate's ``hub_metadata`` reads config.json and only the safetensors headers
(HTTP range requests), never the tensor data.
"""

from __future__ import annotations

import glob
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import structlog

from loraplex.engine.server.model_files import (
    CONFIG_FILE,
    INDEX_FILE,
    ModelAccessError,
    ModelFormatError,
    ModelMetadata,
    ModelNetworkError,
    ModelNotFoundError,
    ModelOfflineError,
    ModelSourceError,
    TensorMeta,
    check_model_dir,
    local_metadata,
    metadata_from,
    plan_files,
    read_json,
)

__all__ = ["fetch_hub_model", "hub_metadata", "hub_options", "is_offline"]

log = structlog.get_logger("loraplex.server")
_SHA = re.compile(r"[0-9a-f]{40}")
_TRUE = {"1", "on", "yes", "true"}


def is_offline() -> bool:
    """HF_HUB_OFFLINE, as read now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
    return env or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def hub_options(download_dir: str | None) -> dict[str, Any]:
    """Endpoint, token and cache folder, read from the environment now (huggingface_hub reads
    them once at import)."""
    from huggingface_hub import constants

    cache = (
        download_dir or os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    )
    if not cache and os.environ.get("HF_HOME"):
        cache = os.path.join(os.environ["HF_HOME"], "hub")
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    return {
        "endpoint": endpoint.rstrip("/"),
        "token": os.environ.get("HF_TOKEN") or None,  # None: the token huggingface_hub stores
        "cache_dir": os.path.expanduser(cache or constants.HF_HUB_CACHE),
    }


def _name(repo_id: str, subdir: str, revision: str | None = None) -> str:
    sub = f"/{subdir}" if subdir else ""
    return f"{repo_id}{sub}" + (f"@{revision}" if revision else "")


def _error(e: BaseException, repo_id: str, revision: str, endpoint: str) -> ModelSourceError:
    """One typed error for whatever huggingface_hub raised."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)
    where = f"{repo_id!r} on {endpoint}"
    if isinstance(e, GatedRepoError):
        return ModelAccessError(
            f"{where} is a gated repository (HTTP {status}): accept its terms on the Hub, then "
            "set HF_TOKEN to a token of an account that has access"
        )
    if isinstance(e, RepositoryNotFoundError) or (
        isinstance(e, HfHubHTTPError) and status in (401, 403)
    ):
        if status in (401, 403):
            return ModelAccessError(
                f"repository {where} was not found or is not accessible (HTTP {status}): if it "
                "is private or gated, set HF_TOKEN to a token that can read it"
            )
        return ModelNotFoundError(f"repository {where} not found")
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFoundError(f"revision {revision!r} of {where} not found")
    if isinstance(e, EntryNotFoundError) and not isinstance(e, FileNotFoundError):
        return ModelNotFoundError(f"{where}: a listed file is missing at {revision!r}: {e}")
    if isinstance(e, HfHubHTTPError):
        return ModelNetworkError(f"the Hub at {endpoint} answered HTTP {status} for {repo_id!r}")
    return ModelNetworkError(
        f"cannot reach the Hub at {endpoint} for {repo_id!r}: {type(e).__name__}: {e}"
    )


def cached_model(repo_id: str, subdir: str, revision: str, cache_dir: str) -> Path | None:
    """The complete cached snapshot of ``repo_id@revision`` (a branch or tag as recorded under
    refs/ by an earlier download), or None if there is none."""
    from huggingface_hub import try_to_load_from_cache

    name = f"{subdir}/{CONFIG_FILE}" if subdir else CONFIG_FILE
    found = try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=revision)
    if not isinstance(found, str):
        return None
    folder = Path(found).parent
    try:
        check_model_dir(folder)
    except ModelFormatError:
        return None  # a partial snapshot (e.g. what a --dry-run fetched)
    return folder


def _from_cache(repo_id: str, subdir: str, revision: str, opts: dict, why: str) -> Path:
    folder = cached_model(repo_id, subdir, revision, opts["cache_dir"])
    if folder is None:
        raise ModelOfflineError(
            f"{_name(repo_id, subdir, revision)} is not in the cache {opts['cache_dir']} and "
            f"{why}: download it once with network access (unset HF_HUB_OFFLINE)"
        )
    log.info("model_from_cache", model=_name(repo_id, subdir, revision), path=str(folder), why=why)
    return folder


def _listing(repo_id: str, subdir: str, revision: str, opts: dict) -> tuple[str, dict[str, int]]:
    """(commit sha, file name -> size) of the folder ``subdir`` at ``revision``."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=opts["endpoint"], token=opts["token"], library_name="loraplex")
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - mapped to one typed error
        raise _error(e, repo_id, revision, opts["endpoint"]) from e
    sha = info.sha or ""
    if not _SHA.fullmatch(sha):
        raise ModelNetworkError(f"the Hub returned no commit for {_name(repo_id, '', revision)}")
    prefix = f"{subdir}/" if subdir else ""
    files = {}
    for sib in info.siblings or ():
        rest = sib.rfilename[len(prefix) :] if sib.rfilename.startswith(prefix) else ""
        if rest and "/" not in rest:
            files[rest] = int(sib.size or 0)
    if not files:
        raise ModelNotFoundError(f"{_name(repo_id, subdir, revision)}: no files in that folder")
    return sha, files


def _download(repo_id: str, subdir: str, sha: str, name: str, opts: dict) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(
            repo_id,
            name,
            subfolder=subdir or None,
            revision=sha,  # pinned: never the branch name
            cache_dir=opts["cache_dir"],
            token=opts["token"],
            endpoint=opts["endpoint"],
            library_name="loraplex",
        )
    except Exception as e:  # noqa: BLE001 - mapped to one typed error
        raise _error(e, repo_id, sha, opts["endpoint"]) from e
    return Path(path)


def _plan(repo_id: str, subdir: str, sha: str, names: dict[str, int], opts: dict) -> list[str]:
    where = f"hf://{_name(repo_id, subdir, sha)}"
    return plan_files(
        names, lambda: read_json(_download(repo_id, subdir, sha, INDEX_FILE, opts)), where
    )


def _fetch_all(
    repo_id: str, subdir: str, sha: str, files: list[str], sizes: dict, opts: dict, bars: bool
) -> Path:
    """Download ``files`` at ``sha``; returns the snapshot's model folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    prefix = f"{subdir}/" if subdir else ""
    total = sum(sizes.get(f, 0) for f in files)
    model = _name(repo_id, subdir, sha)
    log.info("model_download_start", model=model, files=len(files), bytes=total)
    t0 = time.monotonic()
    if bars:  # huggingface_hub's own progress bars (one for the whole snapshot)
        try:
            root = snapshot_download(
                repo_id,
                revision=sha,
                allow_patterns=[glob.escape(prefix + f) for f in files],
                cache_dir=opts["cache_dir"],
                token=opts["token"],
                endpoint=opts["endpoint"],
                library_name="loraplex",
            )
        except Exception as e:  # noqa: BLE001 - mapped to one typed error
            raise _error(e, repo_id, sha, opts["endpoint"]) from e
        folder = Path(root) / subdir if subdir else Path(root)
    else:  # no TTY: a log line per file instead of bars
        was_disabled = are_progress_bars_disabled()
        disable_progress_bars()
        try:
            with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
                jobs = {pool.submit(_download, repo_id, subdir, sha, f, opts): f for f in files}
                for done, job in enumerate(as_completed(jobs), 1):
                    path = job.result()
                    log.info("model_download_file", model=model, file=jobs[job],
                             bytes=sizes.get(jobs[job], 0), done=f"{done}/{len(files)}")  # fmt: skip
        finally:
            if not was_disabled:
                enable_progress_bars()
        folder = path.parent
    log.info("model_download_done", model=model, path=str(folder), bytes=total,
             seconds=round(time.monotonic() - t0, 2))  # fmt: skip
    return folder


def _record_ref(folder: Path, subdir: str, revision: str, sha: str) -> None:
    """Write ``refs/<revision>`` (the cache's branch / tag -> commit map) for offline start-ups;
    downloads pinned to a commit write none."""
    if revision == sha or _SHA.fullmatch(revision):
        return
    snapshot = folder.parents[len(Path(subdir).parts) - 1] if subdir else folder
    ref = snapshot.parents[1] / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(sha)
    os.replace(tmp, ref)


def fetch_hub_model(
    repo_id: str, subdir: str, revision: str, *, download_dir: str | None, bars: bool
) -> Path:
    """The local folder of the Hub model ``repo_id[/subdir]@revision``, downloaded if needed."""
    opts = hub_options(download_dir)
    if is_offline():
        return _from_cache(repo_id, subdir, revision, opts, "offline mode is on (HF_HUB_OFFLINE)")
    try:
        sha, sizes = _listing(repo_id, subdir, revision, opts)
    except ModelNetworkError as e:
        if cached_model(repo_id, subdir, revision, opts["cache_dir"]) is None:
            raise
        log.warning("model_hub_unreachable", error=str(e))
        return _from_cache(repo_id, subdir, revision, opts, "the Hub cannot be reached")
    files = _plan(repo_id, subdir, sha, sizes, opts)
    folder = _fetch_all(repo_id, subdir, sha, files, sizes, opts, bars)
    check_model_dir(folder)
    _record_ref(folder, subdir, revision, sha)
    return folder


def hub_metadata(
    repo_id: str, subdir: str, revision: str, *, download_dir: str | None
) -> ModelMetadata:
    """config.json and the safetensors headers of a Hub model, without its tensor data: a
    complete cached snapshot is read locally, else config.json (and the index) are downloaded
    and the headers read with HTTP range requests."""
    opts = hub_options(download_dir)
    if is_offline():
        return local_metadata(_from_cache(repo_id, subdir, revision, opts, "offline mode is on"))
    sha, sizes = _listing(repo_id, subdir, revision, opts)
    files = _plan(repo_id, subdir, sha, sizes, opts)
    cached = cached_model(repo_id, subdir, sha, opts["cache_dir"])
    if cached is not None:
        return local_metadata(cached)
    config = read_json(_download(repo_id, subdir, sha, CONFIG_FILE, opts))
    headers = {f: _remote_header(repo_id, subdir, sha, f, opts) for f in files
               if f.endswith(".safetensors")}  # fmt: skip
    return metadata_from(f"hf://{_name(repo_id, subdir, sha)}", config, headers)


def _remote_header(repo_id: str, subdir: str, sha: str, name: str, opts: dict) -> list[TensorMeta]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=opts["endpoint"], token=opts["token"], library_name="loraplex")
    path = f"{subdir}/{name}" if subdir else name
    try:
        meta = api.parse_safetensors_file_metadata(repo_id, path, revision=sha)
    except Exception as e:  # noqa: BLE001 - mapped to one typed error
        if type(e).__name__ == "SafetensorsParsingError":
            raise ModelFormatError(f"hf://{repo_id}/{path}: {e}") from e
        raise _error(e, repo_id, sha, opts["endpoint"]) from e
    return [
        TensorMeta(key, str(t.dtype), tuple(t.shape), int(t.data_offsets[1] - t.data_offsets[0]))
        for key, t in meta.tensors.items()
    ]
