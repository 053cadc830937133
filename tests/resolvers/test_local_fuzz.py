"""Fuzzed source URIs against the policy and the local resolver: every outcome is a typed
LoRAError (a 4xx at the admin route) or the in-root adapter itself; nothing outside the root
is ever fetched, whatever the spelling (``..``, ``%2e``, ``//``, symlinks, NUL, surrogates)."""

from __future__ import annotations

import asyncio
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.adapters.digest import adapter_digest
from loraplex.engine.errors import LoRAError
from loraplex.resolvers import ResolverSettings, SourcePolicy
from loraplex.resolvers.local import LocalResolver
from tests.resolvers.tiny_adapter import write_adapter


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, str]:
    """(tmp, root, digest of the adapter at root/a, digest of the one outside the root)."""
    tmp = tmp_path_factory.mktemp("uri-fuzz")
    root = tmp / "root"
    inside = write_adapter(root / "a", seed=0)
    outside = write_adapter(tmp / "outside" / "a", seed=1)
    (root / "link-out").symlink_to(tmp / "outside", target_is_directory=True)
    (root / "link-in").symlink_to(inside, target_is_directory=True)
    return tmp, root, adapter_digest(inside), adapter_digest(outside)


_segment = st.one_of(
    st.sampled_from(
        ["a", "..", ".", "", "link-out", "link-in", "%2e%2e", "%2F", "a%00", "outside", "root"]
    ),
    st.text(alphabet="a./%\\:?#~\x00\ud800 ", max_size=6),
)


@st.composite
def _uri(draw: st.DrawFn) -> str:
    start = draw(st.sampled_from(["{root}", "{tmp}", "", "~", "/"]))
    path = "/".join([start, *draw(st.lists(_segment, max_size=4))])
    form = draw(st.sampled_from(["plain", "file", "file-host", "scheme"]))
    if form == "file":
        return "file://" + path
    if form == "file-host":
        return "file://" + draw(st.sampled_from(["localhost", "evil.example", ""])) + path
    if form == "scheme":
        return draw(st.sampled_from(["FILE://", "file:", "file:///", "hf://"])) + path
    return path


@settings(
    max_examples=150,
    deadline=timedelta(seconds=5),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(uri=_uri())
def test_fuzzed_uris_fetch_the_root_adapter_or_fail_typed(
    layout: tuple[Path, Path, str, str], uri: str
) -> None:
    tmp, root, want, bad = layout
    uri = uri.replace("{root}", str(root)).replace("{tmp}", str(tmp))
    resolver = LocalResolver(ResolverSettings(policy=SourcePolicy(local_roots=[root])))
    with tempfile.TemporaryDirectory() as out:
        dest = Path(out) / "dest"
        try:
            asyncio.run(resolver.fetch(uri, dest))
        except LoRAError:
            return
        got = adapter_digest(dest)
        assert got != bad, uri
        assert got == want, uri
