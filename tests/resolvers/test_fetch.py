"""Rules every resolver inherits from Resolver.fetch, exercised through an in-memory resolver."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterPolicyError,
    AdapterSourceError,
    AdapterTooLargeError,
)
from loraplex.plugins import PluginManager, hookimpl
from loraplex.resolvers import (
    AdapterSource,
    Report,
    Resolver,
    ResolverSettings,
    SourcePolicy,
    fetch_adapter,
)

CFG, W = "adapter_config.json", "adapter_model.safetensors"
BLOBS = {CFG: b'{"peft_type": "LORA"}', W: bytes(range(256)) * 8}
ALLOW = ResolverSettings(policy=SourcePolicy(allow=["mem://*"]))


class MemSource(AdapterSource):
    def __init__(self, blobs: dict[str, bytes], listed: dict[str, int | None], hang: bool) -> None:
        self.blobs, self.files, self.hang, self.pinned_uri = blobs, listed, hang, "mem://a@v1"

    async def download(self, name: str, target: Path, report: Report) -> None:
        data = self.blobs[name]
        with open(target, "wb") as f:  # blocking is fine in a test double
            for i in range(0, len(data), 100):
                f.write(data[i : i + 100])
                report(len(data[i : i + 100]))
                if self.hang and name == W:
                    await asyncio.Event().wait()


class MemResolver(Resolver):
    schemes = ("mem",)

    def __init__(self, settings: ResolverSettings, listed=None, blobs=None, hang=False) -> None:
        super().__init__(settings)
        self.blobs = blobs or BLOBS
        self.listed = {k: len(v) for k, v in self.blobs.items()} if listed is None else listed
        self.hang = hang

    async def open(self, uri: str) -> AdapterSource:
        if self.listed == {} and uri.endswith("boom"):
            raise ConnectionResetError("peer went away")
        return MemSource(self.blobs, self.listed, self.hang)


async def test_fetch_writes_both_files_and_logs(tmp_path: Path) -> None:
    with capture_logs() as logs:
        res = await MemResolver(ALLOW).fetch("mem://a", tmp_path / "d")
    assert (res.pinned_uri, res.nbytes) == ("mem://a@v1", sum(map(len, BLOBS.values())))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [CFG, W]
    events = [e["event"] for e in logs]
    assert events == [
        "adapter_fetch_start",
        "adapter_fetch_file",
        "adapter_fetch_file",
        "adapter_fetch_done",
    ]


async def test_quota_enforced_while_streaming_when_size_unknown(tmp_path: Path) -> None:
    r = MemResolver(ALLOW, listed={CFG: None, W: None})
    with pytest.raises(AdapterTooLargeError, match=f"quota of 1000 bytes \\(at {W}\\)"):
        await r.fetch("mem://a", tmp_path / "d", max_bytes=1000)
    assert list((tmp_path / "d").iterdir()) == []  # partial and finished files removed


async def test_size_differs_from_listing(tmp_path: Path) -> None:
    r = MemResolver(ALLOW, listed={CFG: len(BLOBS[CFG]), W: 10})
    with pytest.raises(AdapterSourceError, match="the source listed 10"):
        await r.fetch("mem://a", tmp_path / "d")


@pytest.mark.parametrize(
    ("listed", "error", "match"),
    [
        ({CFG: 5, "adapter_model.bin": 9}, AdapterFormatError, "safetensors required"),
        ({"README.md": 5}, AdapterNotFoundError, "holds no adapter"),
        ({CFG: 5}, AdapterFormatError, f"no {W}"),
        ({W: 5}, AdapterConfigError, f"no {CFG}"),
        ({CFG: 2 << 20, W: 5}, AdapterConfigError, "byte limit"),
    ],
)
async def test_listing_rules(tmp_path: Path, listed: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        await MemResolver(ALLOW, listed=listed).fetch("mem://a", tmp_path / "d")
    assert not (tmp_path / "d").exists()


async def test_other_errors_become_source_errors(tmp_path: Path) -> None:
    with pytest.raises(AdapterSourceError, match="peer went away") as ei:
        await MemResolver(ALLOW, listed={}).fetch("mem://boom", tmp_path / "d")
    assert isinstance(ei.value.__cause__, ConnectionResetError)


async def test_policy_is_enforced_inside_fetch(tmp_path: Path) -> None:
    with pytest.raises(AdapterPolicyError):
        await MemResolver(ResolverSettings()).fetch("mem://a", tmp_path / "d")
    with pytest.raises(AdapterSourceError, match="cannot fetch"):
        await MemResolver(ALLOW).fetch("s3://bucket/a", tmp_path / "d")


async def test_cancellation_cleans_up(tmp_path: Path) -> None:
    task = asyncio.create_task(MemResolver(ALLOW, hang=True).fetch("mem://a", tmp_path / "d"))
    while not (tmp_path / "d" / f".{W}.part").exists():
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list((tmp_path / "d").iterdir()) == []


class MemPlugin:
    @hookimpl
    def loraplex_resolvers(self, settings: ResolverSettings) -> list[Resolver]:
        return [MemResolver(settings)]


async def test_fetch_adapter_checks_both_policies(tmp_path: Path) -> None:
    manager = PluginManager(enabled=[], settings=ALLOW)
    manager.register(MemPlugin(), "mem")
    res = await fetch_adapter("mem://a", tmp_path / "d", manager=manager, max_bytes=1 << 20)
    assert res.nbytes == sum(map(len, BLOBS.values()))
    with pytest.raises(AdapterPolicyError):
        await fetch_adapter("mem://a", tmp_path / "e", manager=manager, policy=SourcePolicy())
    with pytest.raises(AdapterPolicyError):  # outside the manager's allowlist
        await fetch_adapter("hf://org/repo", tmp_path / "f", manager=manager)
    strict = PluginManager(enabled=[], settings=ResolverSettings())
    strict.register(MemPlugin(), "mem")
    with pytest.raises(AdapterPolicyError):  # the caller's policy allows it, the resolver's not
        await fetch_adapter("mem://a", tmp_path / "g", manager=strict, policy=ALLOW.policy)
