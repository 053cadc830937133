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
    AdapterSourceError,
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


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 1 KiB, 3 in flight: the tiny adapter's weights take the ranged path."""
    monkeypatch.setattr("loraplex.resolvers.s3.S3_PART_BYTES", 1024)
    monkeypatch.setattr("loraplex.resolvers.s3.S3_PARALLEL_PARTS", 3)


async def test_ranged_parallel_fetch_matches_original(
    bucket: str, tmp_path: Path, small_parts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplex.resolvers import s3 as s3mod

    ranges: list[tuple[int, int]] = []
    real = s3mod._S3Source._get_range

    async def counted(self, bucket_, key, etag, lo, hi, name):  # type: ignore[no-untyped-def]
        ranges.append((lo, hi))
        return await real(self, bucket_, key, etag, lo, hi, name)

    monkeypatch.setattr(s3mod._S3Source, "_get_range", counted)
    res = await S3Resolver(ALLOW).fetch(f"s3://{bucket}/good", tmp_path / "d")
    size = (tmp_path / "src" / "adapter_model.safetensors").stat().st_size
    assert size > 3 * 1024  # several parts, more than one round of the gate
    assert sorted(ranges) == [(lo, min(lo + 1024, size)) for lo in range(0, size, 1024)]
    assert adapter_digest(res.local_dir) == adapter_digest(tmp_path / "src")


async def test_object_replaced_mid_download_fails_typed(
    bucket: str, endpoint: str, tmp_path: Path, small_parts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new version of the object between two ranges: If-Match refuses the later ranges, so
    the fetch fails instead of writing a file of two versions' bytes."""
    from loraplex.resolvers import s3 as s3mod

    real = s3mod._S3Source._get_range
    replaced: list[bool] = []

    async def replace_first(self, bucket_, key, etag, lo, hi, name):  # type: ignore[no-untyped-def]
        if not replaced:
            replaced.append(True)
            body = (tmp_path / "src" / "adapter_model.safetensors").read_bytes()
            boto3.client("s3", endpoint_url=endpoint).put_object(
                Bucket=bucket_, Key=key, Body=body[:-1] + bytes([body[-1] ^ 1])
            )
        return await real(self, bucket_, key, etag, lo, hi, name)

    monkeypatch.setattr(s3mod._S3Source, "_get_range", replace_first)
    with pytest.raises(AdapterSourceError, match="changed on the source"):
        await S3Resolver(ALLOW).fetch(f"s3://{bucket}/good", tmp_path / "d")
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())
