"""Fixtures shared by the resolver tests: a tiny adapter under an allowed root."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.resolvers import ResolverSettings, SourcePolicy
from tests.resolvers.tiny_adapter import write_adapter


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An operator root holding one adapter at ``<root>/good``."""
    r = tmp_path / "root"
    write_adapter(r / "good")
    return r


@pytest.fixture
def settings(root: Path) -> ResolverSettings:
    return ResolverSettings(policy=SourcePolicy(local_roots=[root]), chunk_bytes=512)


@pytest.fixture
def dest(tmp_path: Path) -> Path:
    return tmp_path / "dest"
