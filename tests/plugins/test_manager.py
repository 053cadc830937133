"""PluginManager: entry-point loading, filtering, in-process plugins, typed wrappers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.engine.errors import AdapterSourceError
from loraplex.plugins import (
    BUILTIN_PLUGINS,
    ENTRY_POINT_GROUP,
    PluginLoadError,
    PluginManager,
    hookimpl,
)
from loraplex.resolvers import AdapterSource, Resolver, ResolverSettings
from loraplex.resolvers.huggingface import HuggingFaceResolver
from loraplex.resolvers.local import LocalResolver
from loraplex.resolvers.s3 import S3Resolver

REPO = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


class _Nothing(Resolver):
    schemes = ("nothing",)

    async def open(self, uri: str) -> AdapterSource:
        raise NotImplementedError


class NamePlugin:
    """Maps names with a prefix to a bucket; other names to None."""

    def __init__(self, prefix: str, uri: str) -> None:
        self.prefix, self.uri = prefix, uri

    @hookimpl
    def loraplex_resolve_adapter_name(self, name: str) -> str | None:
        return self.uri.format(name=name) if name.startswith(self.prefix) else None


def test_builtins_load_through_entry_points() -> None:
    pm = PluginManager()
    assert sorted(pm.plugin_names) == sorted(BUILTIN_PLUGINS)
    assert isinstance(pm.resolver_for("/srv/adapters/a"), LocalResolver)
    assert isinstance(pm.resolver_for("file:///srv/adapters/a"), LocalResolver)
    assert isinstance(pm.resolver_for("hf://org/repo@main"), HuggingFaceResolver)
    assert isinstance(pm.resolver_for("S3://bucket/a"), S3Resolver)
    settings = ResolverSettings(hf_token="x")
    assert PluginManager(settings=settings).resolver_for("hf://o/r").settings is settings


def test_pyproject_registers_builtins_in_the_entry_point_group() -> None:
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps[ENTRY_POINT_GROUP] == {
        "local": "loraplex.resolvers.local",
        "huggingface": "loraplex.resolvers.huggingface",
        "s3": "loraplex.resolvers.s3",
    }


def test_enabled_list_filters() -> None:
    pm = PluginManager(enabled=["local"])
    assert pm.plugin_names == ["local"]
    with pytest.raises(AdapterSourceError, match="no resolver for URI scheme 's3'.*enabled: file"):
        pm.resolver_for("s3://bucket/a")
    assert PluginManager(enabled=[]).resolvers() == {}


def test_unknown_plugin_name_fails_loudly() -> None:
    with pytest.raises(PluginLoadError, match="typo.*not installed"):
        PluginManager(enabled=["local", "typo"])


def test_resolve_name_first_result_wins() -> None:
    pm = PluginManager(enabled=[])
    assert pm.resolve_name("team-a") is None
    pm.register(NamePlugin("team-", "s3://first/{name}"), "first")
    pm.register(NamePlugin("team-", "s3://second/{name}"), "second")
    # pluggy calls the most recently registered plugin first
    assert pm.resolve_name("team-a") == "s3://second/team-a"
    assert pm.resolve_name("other") is None
    pm.unregister("second")
    assert pm.resolve_name("team-a") == "s3://first/team-a"


def test_register_rejects_unknown_hooks_and_duplicates() -> None:
    class Typo:
        @hookimpl
        def loraplex_resolver(self, settings: ResolverSettings) -> list[Resolver]:
            return []

    pm = PluginManager(enabled=[])
    with pytest.raises(PluginLoadError, match="loraplex_resolver"):
        pm.register(Typo(), "typo")
    assert pm.plugin_names == []
    pm.register(NamePlugin("x", "y"), "dup")
    with pytest.raises(PluginLoadError, match="'dup'"):
        pm.register(NamePlugin("x", "y"), "dup")


def test_scheme_conflicts_and_bad_results() -> None:
    class Twice:
        @hookimpl
        def loraplex_resolvers(self, settings: ResolverSettings) -> list[Resolver]:
            return [_Nothing(settings)]

    class NotAResolver:
        @hookimpl
        def loraplex_resolvers(self, settings: ResolverSettings) -> list[object]:
            return [object()]

    pm = PluginManager(enabled=[])
    pm.register(Twice(), "one")
    assert isinstance(pm.resolver_for("nothing://x"), _Nothing)
    pm.register(Twice(), "two")
    with pytest.raises(PluginLoadError, match="claimed by both"):
        pm.resolver_for("nothing://x")
    pm2 = PluginManager(enabled=[])
    pm2.register(NotAResolver(), "bad")
    with pytest.raises(PluginLoadError, match="not a Resolver"):
        pm2.resolvers()


def test_importing_the_packages_does_not_import_backends() -> None:
    code = (
        "import sys, loraplex.plugins, loraplex.resolvers;"
        "bad = [m for m in ('s3fs', 'huggingface_hub', 'loraplex.resolvers.s3') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
