"""benchmarks.load_passes runs its loads through the engine's fetcher into a host pool and
leaves nothing behind (each run writes ~1 GB of adapters at rank 16)."""

from __future__ import annotations

import argparse
import tempfile

import benchmarks.load_passes as load_passes


async def test_a_run_prints_every_stage_and_removes_its_adapters(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    args = argparse.Namespace(sizes=["27MB"], repeats=1, rank=1, helpers=0, dynamic=False,
                              threads=1)  # fmt: skip
    await load_passes.run(args)
    out = capsys.readouterr().out
    assert "| 27MB (" in out and "| verify | preflight |" in out
    assert list(tmp_path.iterdir()) == []
