"""The S3 resolver against moto's S3 server over real HTTP on 127.0.0.1."""

from __future__ import annotations

import itertools
from pathlib import Path

import boto3
import pytest

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.errors import (
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterPolicyError,
    AdapterTooLargeError,
)
from loraplex.resolvers import ResolverSettings, SourcePolicy
from loraplex.resolvers.s3 import S3Resolver
from tests.resolvers.tiny_adapter import write_adapter

moto_server = pytest.importorskip("moto.server")
_buckets = itertools.count()
ALLOW = ResolverSettings(policy=SourcePolicy(allow=["s3://*"]))


@pytest.fixture
def bucket(endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh bucket holding ``good/`` (an adapter) and ``pickled/`` (.bin only)."""
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    name = f"adapters-{next(_buckets)}"
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket=name)
    src = write_adapter(tmp_path / "src")
    for f in src.iterdir():
        s3.upload_file(str(f), name, f"good/{f.name}")
    s3.put_object(Bucket=name, Key="good/README.md", Body=b"not fetched")
    s3.put_object(Bucket=name, Key="pickled/adapter_config.json", Body=b"{}")
    s3.put_object(Bucket=name, Key="pickled/adapter_model.bin", Body=b"\x80\x04pickle")
    return name


async def test_fetch_matches_original(bucket: str, tmp_path: Path) -> None:
    res = await S3Resolver(ALLOW).fetch(f"s3://{bucket}/good", tmp_path / "d")
    assert res.pinned_uri == f"s3://{bucket}/good"
    assert sorted(p.name for p in res.local_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert adapter_digest(res.local_dir) == adapter_digest(tmp_path / "src")
    assert res.nbytes == sum(f.stat().st_size for f in (tmp_path / "src").iterdir())


async def test_explicit_settings_without_environment(
    bucket: str, endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    settings = ResolverSettings(
        policy=ALLOW.policy, s3_endpoint_url=endpoint, s3_key="testing", s3_secret="testing"
    )
    res = await S3Resolver(settings).fetch(f"s3://{bucket}/good/", tmp_path / "d")
    assert adapter_digest(res.local_dir) == adapter_digest(tmp_path / "src")


async def test_bin_only_is_refused(bucket: str, tmp_path: Path) -> None:
    with pytest.raises(AdapterFormatError, match="safetensors required"):
        await S3Resolver(ALLOW).fetch(f"s3://{bucket}/pickled", tmp_path / "d")
    assert not (tmp_path / "d").exists()


async def test_missing_prefix(bucket: str, tmp_path: Path) -> None:
    with pytest.raises(AdapterNotFoundError):
        await S3Resolver(ALLOW).fetch(f"s3://{bucket}/nothing-here", tmp_path / "d")


async def test_quota(bucket: str, tmp_path: Path) -> None:
    with pytest.raises(AdapterTooLargeError):
        await S3Resolver(ALLOW).fetch(f"s3://{bucket}/good", tmp_path / "d", max_bytes=1000)
    assert not (tmp_path / "d").exists()


async def test_allowlist(bucket: str, tmp_path: Path) -> None:
    settings = ResolverSettings(policy=SourcePolicy(allow=["s3://other-bucket/*"]))
    with pytest.raises(AdapterPolicyError):
        await S3Resolver(settings).fetch(f"s3://{bucket}/good", tmp_path / "d")
