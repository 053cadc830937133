"""examples/custom_resolver_plugin: a separately installable plugin with a demo:// resolver.

Installing it with pip in a subprocess is slow, so the test puts its folder on sys.path, loads
the object its entry point names and registers it in-process, and separately checks that its
pyproject declares that entry point.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.errors import AdapterNotFoundError, AdapterPolicyError
from loraplex.plugins import ENTRY_POINT_GROUP, PluginManager
from loraplex.resolvers import ResolverSettings, SourcePolicy, fetch_adapter
from tests.resolvers.tiny_adapter import write_adapter

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_resolver_plugin"
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _entry_point() -> EntryPoint:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    (name, value), *_ = project["entry-points"][ENTRY_POINT_GROUP].items()
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def test_pyproject_declares_the_entry_point() -> None:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert project["name"] == "loraplex-demo-resolver"
    assert "loraplex" in project["dependencies"]
    assert project["entry-points"][ENTRY_POINT_GROUP] == {"demo": "loraplex_demo_resolver"}


@pytest.fixture
def manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PluginManager:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    ep = _entry_point()
    settings = ResolverSettings(
        policy=SourcePolicy(allow=["demo://*"]), options={"demo": {"root": str(tmp_path / "lib")}}
    )
    pm = PluginManager(enabled=[], settings=settings)
    pm.register(ep.load(), ep.name)
    return pm


async def test_fetch_through_the_example_plugin(manager: PluginManager, tmp_path: Path) -> None:
    src = write_adapter(tmp_path / "lib" / "my-adapter")
    uri = manager.resolve_name("my-adapter")
    assert uri == "demo://my-adapter"
    res = await fetch_adapter(uri, tmp_path / "d", manager=manager, max_bytes=1 << 20)
    assert res.pinned_uri == uri
    assert adapter_digest(res.local_dir) == adapter_digest(src)
    with pytest.raises(AdapterNotFoundError):
        await fetch_adapter("demo://absent", tmp_path / "e", manager=manager)
    with pytest.raises(AdapterPolicyError):
        await fetch_adapter("demo://../lib/my-adapter", tmp_path / "f", manager=manager)
    assert manager.resolve_name("Not/A/Name") is None
