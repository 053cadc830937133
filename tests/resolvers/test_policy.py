"""SourcePolicy: allowlist for remote URIs, real-path roots for local ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loraplex.engine.errors import AdapterPolicyError, AdapterSourceError
from loraplex.resolvers import SourcePolicy, scheme_of
from loraplex.resolvers import policy as policy_module


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


def test_one_by_one_dirs_are_a_set_of_real_paths(tmp_path: Path, monkeypatch) -> None:
    """Static local sources (``allowing``) are kept once each at their real path when allowed:
    re-allowing does not grow the policy, and a check resolves the candidate, not every
    allowed directory (its cost does not grow with the number of registered adapters)."""
    dirs = [tmp_path / "adapters" / f"a{i}" for i in range(300)]
    for d in dirs:
        (d / "sub").mkdir(parents=True)
    p = SourcePolicy()
    for d in dirs:
        p = p.allowing([str(d)]).allowing([d.as_uri()])  # the same directory twice
    assert len(p.local_dirs) == len(dirs) and p.local_roots == ()
    calls = []
    real = policy_module._realpath
    monkeypatch.setattr(policy_module, "_realpath", lambda x: calls.append(x) or real(x))
    assert p.local_path(str(dirs[7] / "sub")) == Path(os.path.realpath(dirs[7] / "sub"))
    assert len(calls) == 1  # the candidate only
    assert p.root_of(os.path.realpath(dirs[7] / "sub")) == os.path.realpath(dirs[7])
    with pytest.raises(AdapterPolicyError, match="outside the allowed roots"):
        p.check(str(tmp_path / "adapters"))  # the parent of allowed directories is not allowed
    # an operator root holding an allowed directory: the innermost root wins
    both = SourcePolicy(local_roots=[tmp_path]).union(p)
    assert both.root_of(os.path.realpath(dirs[3])) == os.path.realpath(dirs[3])
    assert both.root_of(os.path.realpath(tmp_path / "adapters")) == os.path.realpath(tmp_path)


def test_a_one_by_one_dir_swapped_for_a_symlink_is_refused(tmp_path: Path) -> None:
    """The directory is allowed at the real path it had when it was allowed: replaced later by
    a link elsewhere, the link's target is not allowed."""
    allowed, elsewhere = tmp_path / "allowed", tmp_path / "elsewhere"
    allowed.mkdir()
    elsewhere.mkdir()
    p = SourcePolicy().allowing([str(allowed)])
    p.check(str(allowed))
    allowed.rmdir()
    allowed.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(AdapterPolicyError, match="resolves to"):
        p.check(str(allowed))
