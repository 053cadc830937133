"""SourcePolicy: allowlist for remote URIs, real-path roots for local ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraplex.engine.lora.errors import AdapterPolicyError, AdapterSourceError
from loraplex.resolvers import SourcePolicy, scheme_of


def test_scheme_of() -> None:
    assert scheme_of("hf://a/b") == "hf"
    assert scheme_of("S3://bucket/x") == "s3"
    assert scheme_of("file:///srv/a") == "file"
    assert scheme_of("/srv/a") == "file"
    assert scheme_of("relative/dir") == "file"


def test_default_policy_allows_nothing(tmp_path: Path) -> None:
    with pytest.raises(AdapterPolicyError, match="matches no allowed source pattern"):
        SourcePolicy().check("hf://org/repo")
    with pytest.raises(AdapterPolicyError, match="no local roots"):
        SourcePolicy().check(str(tmp_path))


def test_allowlist_patterns() -> None:
    p = SourcePolicy(allow=["hf://myorg/*", "s3://adapters/prod/*"])
    p.check("hf://myorg/repo")
    p.check("hf://myorg/repo/sub@main")
    p.check("s3://adapters/prod/a")
    for uri in ("hf://other/repo", "s3://adapters/dev/a", "s3://adapters-prod/a", "HF://myorg/x"):
        with pytest.raises(AdapterPolicyError, match="matches no allowed"):
            p.check(uri)


@pytest.mark.parametrize(
    "uri",
    [
        "hf://myorg/../evil/repo",
        "hf://myorg/./repo",
        "hf://myorg//repo",
        "hf://myorg/r?x=1",
        "hf://myorg/r#f",
        "hf://myorg/r epo",
        "hf://myorg/r\\x",
    ],
)
def test_remote_uri_tricks_are_refused_even_if_a_pattern_matches(uri: str) -> None:
    with pytest.raises(AdapterPolicyError):
        SourcePolicy(allow=["hf://myorg/*"]).check(uri)


def test_allowing_adds_exact_uris_and_local_dirs(tmp_path: Path) -> None:
    p = SourcePolicy().allowing(["s3://b/one[1]", str(tmp_path)])
    p.check("s3://b/one[1]")  # verbatim, not a glob
    p.check(str(tmp_path))
    with pytest.raises(AdapterPolicyError):
        p.check("s3://b/one1")


def test_local_roots(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    p = SourcePolicy(local_roots=[root])
    assert p.local_path(str(root / "a")) == Path(os.path.realpath(root / "a"))
    p.check((root / "a").as_uri())
    with pytest.raises(AdapterPolicyError, match="outside the allowed roots"):
        p.check(str(outside))
    with pytest.raises(AdapterPolicyError, match=r"contains '\.\.'"):
        p.check(f"{root}/a/../a")
    with pytest.raises(AdapterPolicyError, match="remote host"):
        p.check("file://evil.example/srv/a")
    (root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(AdapterPolicyError, match="resolves to"):
        p.check(str(root / "link"))


def test_malformed_uri_counts_as_a_local_path_and_needs_a_root() -> None:
    with pytest.raises(AdapterSourceError):
        SourcePolicy(allow=["*"]).check("hf:/x")  # a relative local path, no roots
