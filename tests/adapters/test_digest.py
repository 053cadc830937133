"""adapter_digest equals `sha256sum adapter_config.json adapter_model.safetensors | sha256sum`."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from loraplex.engine.adapters.digest import (
    adapter_digest,
    adapter_digest_async,
    check_digest,
    file_sha256,
    sha256sum_text,
)
from loraplex.engine.errors import AdapterDigestError, AdapterFormatError
from tests.resolvers.tiny_adapter import write_adapter

needs_sha256sum = pytest.mark.skipif(shutil.which("sha256sum") is None, reason="no sha256sum")


def _sh(cmd: str, cwd: Path) -> str:
    return subprocess.run(
        cmd, shell=True, cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


@needs_sha256sum
def test_matches_sha256sum(tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a")
    (d / "README.md").write_text("not part of the digest")
    files = "adapter_config.json adapter_model.safetensors"
    assert sha256sum_text(d) == _sh(f"sha256sum {files}", d)
    assert adapter_digest(d) == _sh(f"sha256sum {files} | sha256sum", d).split()[0]


@needs_sha256sum
def test_matches_sha256sum_for_a_multi_chunk_file(tmp_path: Path) -> None:
    d = write_adapter(
        tmp_path / "a", rank=8, targets=("q_proj", "gate_proj", "up_proj", "down_proj")
    )
    with open(d / "adapter_model.safetensors", "ab") as f:  # digest is of bytes, not validity
        f.write(b"x" * (3 << 20))
    files = "adapter_config.json adapter_model.safetensors"
    assert adapter_digest(d) == _sh(f"sha256sum {files} | sha256sum", d).split()[0]


def test_file_sha256_streams(tmp_path: Path) -> None:
    p = tmp_path / "blob"
    p.write_bytes(bytes(range(256)) * 41)
    assert file_sha256(p, chunk_bytes=7) == hashlib.sha256(p.read_bytes()).hexdigest()


async def test_async_twin_and_content_sensitivity(tmp_path: Path) -> None:
    a = write_adapter(tmp_path / "a", seed=1)
    b = write_adapter(tmp_path / "b", seed=2)
    assert await adapter_digest_async(a) == adapter_digest(a)
    assert adapter_digest(a) != adapter_digest(b)


def test_check_digest(tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a")
    digest = adapter_digest(d)
    assert check_digest(d, f"sha256:{digest.upper()}") == digest
    with pytest.raises(AdapterDigestError, match="configured sha256 is 0+"):
        check_digest(d, "0" * 64)


def test_missing_file(tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a")
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterFormatError, match="no adapter_model.safetensors"):
        adapter_digest(d)
