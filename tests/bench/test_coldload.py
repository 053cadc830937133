"""The cold-load study (loraplex.engine.bench.coldload) on a tiny random model on CPU: the
installed ``loraplex bench coldload`` outside the checkout, files, the TTFT split, tiers against
the engine's counters, sweeps, and the S3 / Hub sources."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraplex.engine.bench.coldload import cli as coldload_cli
from loraplex.engine.bench.coldload.adapters import TINY, write_adapter_set
from loraplex.engine.bench.coldload.config import Lengths, PointConfig, grid, label_of, parse_sweep
from loraplex.engine.bench.coldload.metrics import PARTS
from loraplex.engine.bench.coldload.sweep import run_study
from loraplex.engine.bench.coldload.workload import make_arrivals, zipf_cdf
from tests.helpers.coldload import FAST
from tests.helpers.coldload import point as _point

pytest.importorskip("matplotlib")

CHECKOUT = Path(__file__).resolve().parents[2]

POINT_FILES = ("result.json", "requests.csv", "loads.csv", "slot_writes.csv")
PLOTS = ("ttft_cdf.png", "itl_timeline.png")


def _check_point_dir(folder: Path) -> dict[str, Any]:
    for name in (*POINT_FILES, *PLOTS):
        assert (folder / name).is_file() and (folder / name).stat().st_size > 0, name
    doc = json.loads((folder / "result.json").read_text())
    with open(folder / "requests.csv") as f:
        assert len(list(csv.DictReader(f))) == len(doc["requests"])
    with open(folder / "loads.csv") as f:
        assert len(list(csv.DictReader(f))) == len(doc["loads"])
    return doc


def _check_consistent(doc: dict[str, Any]) -> None:
    """Stage parts never exceed TTFT and add up to it; tiers match the engine's counters."""
    rows = [r for r in doc["requests"] if r["ttft_s"] is not None]
    assert rows and all(r["finish_reason"] == "length" for r in doc["requests"])
    for r in rows:
        stages = sum(r[f"{p}_s"] for p in PARTS if p not in ("queue", "prefill"))
        assert stages <= r["ttft_s"] + 1e-9, r
        assert sum(r[f"{p}_s"] for p in PARTS) == pytest.approx(r["ttft_s"], abs=1e-6)
        assert min(r[f"{p}_s"] for p in PARTS) >= 0.0
        if r["tier"] in ("gpu", "base"):
            assert stages == 0.0, r
    s = doc["summary"]
    c, engine = s["consistency"], s["engine"]["adapters"]
    assert c["ok"], c
    tiers = {t: sum(r["tier"] == t for r in doc["requests"]) for t in ("gpu", "cpu", "cold")}
    assert tiers["cold"] == engine["misses"] and tiers["cold"] > 0
    assert tiers["gpu"] == engine["gpu_hits"] and tiers["cpu"] == engine["cpu_hits"]
    cold_names = {r["adapter"] for r in doc["requests"] if r["tier"] == "cold"}
    assert len(cold_names) <= engine["loads"] == len(doc["loads"]) <= tiers["cold"]
    assert s["loads"]["fetched"] + s["loads"]["restaged"] == engine["loads"]
    assert s["h2d"]["writes"] == len(doc["slot_writes"]) > 0
    assert s["h2d"]["pinned_gbps"] is None  # CPU: n/a
    itl = s["itl"]
    assert itl["with_load"]["n"] + itl["without_load"]["n"] == sum(
        max(r["output_tokens"] - 1, 0) for r in doc["requests"]
    )


def _installed(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The installed console script and an environment that does not see the checkout."""
    script = Path(sys.executable).parent / "loraplex"
    if not script.is_file():
        pytest.skip("the loraplex console script is not installed next to this interpreter")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; print(u.find_spec('benchmarks'))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert probe.stdout.strip() == "None"  # the checkout's benchmarks/ is out of reach
    assert not Path.cwd().resolve().is_relative_to(tmp_path.resolve())
    assert not tmp_path.resolve().is_relative_to(CHECKOUT)
    return script, env


def test_installed_help_outside_the_checkout(tmp_path: Path) -> None:
    script, env = _installed(tmp_path)
    top = subprocess.run(
        [str(script), "bench", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert top.returncode == 0, top.stderr
    assert "coldload" in top.stdout
    out = subprocess.run(
        [str(script), "bench", "coldload", "--help"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for flag in ("--synthetic", "--num-adapters", "--source", "--sweep", "--out", "--no-plots"):
        assert flag in out.stdout, flag


def test_installed_short_local_study_outside_the_checkout(tmp_path: Path) -> None:
    """``loraplex bench coldload`` run from a folder outside the checkout writes every file."""
    script, env = _installed(tmp_path)
    argv = ["bench", "coldload", "--synthetic", "tiny", "--device", "cpu", "--num-adapters", "10",
            "--rank", "4", "--targets", "q_proj,k_proj,v_proj,o_proj", "--distinct", "3",
            "--prompt-len", "4-24", "--output-len", "3-10", "--rate", "25", "--duration", "1.2",
            "--base-fraction", "0.1", "--max-loras", "2", "--max-cpu-loras", "16",
            "--max-num-seqs", "8", "--out", "out", "--workdir", "work", "--no-progress",
            "--quiet"]  # fmt: skip
    proc = subprocess.run(
        [str(script), *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out, work = tmp_path / "out", tmp_path / "work"
    assert "wrote" in proc.stdout
    doc = _check_point_dir(out)
    assert (out / "summary.txt").read_text().startswith("[run]")
    _check_consistent(doc)
    assert doc["config"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    # the CPU tier holds every adapter: each one is fetched once, never re-staged
    s = doc["summary"]
    cold = {r["adapter"] for r in doc["requests"] if r["tier"] == "cold"}
    assert s["engine"]["adapters"]["loads"] == len(cold) == s["loads"]["fetched"]
    assert s["engine"]["adapters"]["cpu_evictions"] == 0
    folder = work / "set0" / "adapters" / "a0"
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert s["loads"]["bytes_fetched"] == len(cold) * size
    inodes = {p.stat().st_ino for p in (work / "set0" / "adapters").glob("*/*.safetensors")}
    assert len(inodes) == 3  # --distinct 3


def test_missing_bench_extra_fails_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "moto" else real(name, *a)
    )
    p = argparse.ArgumentParser()
    coldload_cli.add_arguments(p)
    args = p.parse_args(["--source", "s3", "--no-plots", "--out", str(tmp_path / "out")])
    assert coldload_cli.run(args) == 2
    assert "[bench]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sweep_2x2_writes_points_table_and_plot(tmp_path: Path) -> None:
    sweep = parse_sweep(["max_loras=1,2", "alpha=0.8,1.2"])
    study = run_study(_point(), tmp_path, sweep=sweep, progress=False, quiet=True)
    assert len(study.results) == 4
    labels = [r.label for r in study.results]
    assert labels[0] == "max_loras-1_alpha-0.8"
    for label in labels:
        _check_consistent(_check_point_dir(tmp_path / "points" / label))
    for name in ("sweep.json", "sweep.csv", "sweep.png", "summary.txt"):
        assert (tmp_path / name).is_file(), name
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["values"] for p in doc["points"]] == [
        {"max_loras": m, "alpha": a} for m in (1, 2) for a in (0.8, 1.2)
    ]
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {"gpu_hit_rate", "ttft_p99_s", "decode_stall_ratio"} <= set(rows[0])
    # the workload is the same at every point of a given alpha (only the engine differs)
    same = [r for r in study.results if r.values["alpha"] == 0.8]
    assert [q["adapter"] for q in same[0].requests] == [q["adapter"] for q in same[1].requests]


@pytest.mark.parametrize("source", ["s3", "hub"])
def test_remote_sources(tmp_path: Path, source: str) -> None:
    before = dict(os.environ)
    study = run_study(
        _point(source=source, num_adapters=6, duration=0.8), tmp_path, progress=False, quiet=True
    )
    doc = _check_point_dir(tmp_path)
    _check_consistent(doc)
    assert doc["summary"]["loads"]["fetched"] > 0 and doc["summary"]["loads"]["failed"] == 0
    assert study.results[0].config.source == source
    assert dict(os.environ) == before  # the source's environment is restored


def test_distinct_hardlinks_and_full_peft_folders(tmp_path: Path) -> None:
    aset = write_adapter_set(
        tmp_path, TINY, num=7, rank=4, targets=("q_proj", "v_proj"), distinct=2
    )
    assert aset.names == [f"a{i}" for i in range(7)] and aset.distinct == 2
    weights = [aset.folder(n) / "adapter_model.safetensors" for n in aset.names]
    assert len({w.stat().st_ino for w in weights}) == 2
    assert all(w.stat().st_nlink == 1 + (4 if i % 2 == 0 else 3) for i, w in enumerate(weights))
    cfg = json.loads((aset.folder("a3") / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="targets"):
        write_adapter_set(tmp_path / "bad", TINY, num=1, rank=4, targets=("lm_head",))


def test_workload_is_seeded_poisson_and_zipf() -> None:
    p = _point(rate=200.0, duration=20.0, alpha=1.1, base_fraction=0.25, num_adapters=50)
    names = [f"n{i}" for i in range(50)]
    a, b = make_arrivals(p, names, 512), make_arrivals(p, names, 512)
    assert [x.t for x in a] == [x.t for x in b] and [x.adapter for x in a] == [x.adapter for x in b]
    assert abs(len(a) - 4000) < 4 * 4000**0.5  # Poisson count: mean rate * duration
    base = sum(x.adapter is None for x in a) / len(a)
    assert abs(base - 0.25) < 0.03
    top = sum(x.adapter == "n0" for x in a) / sum(x.adapter is not None for x in a)
    assert abs(top - zipf_cdf(50, 1.1)[0]) < 0.03
    assert all(4 <= len(x.prompt) <= 24 and 3 <= x.max_tokens <= 10 for x in a)
    other = make_arrivals(PointConfig(**{**p.__dict__, "alpha": 0.5}), names, 512)
    assert [x.t for x in other] == [x.t for x in a]  # alpha changes only the adapter choice


def test_sweep_parsing() -> None:
    sweep = parse_sweep(
        ["max_loras=8,32", "alpha=0.8,1.1", "targets=q_proj+v_proj,o_proj", "source=s3"]
    )
    assert sweep == {
        "max_loras": [8, 32],
        "alpha": [0.8, 1.1],
        "targets": [("q_proj", "v_proj"), ("o_proj",)],
        "source": ["s3"],
    }
    assert parse_sweep(["prompt_len=8-16,32"]) == {"prompt_len": [Lengths(8, 16), Lengths(32, 32)]}
    # the load path's concurrency: the engine's defaults unless swept
    from loraplex.engine.bench.coldload.run import engine_config

    default = engine_config(PointConfig(device="cpu"), {})
    assert default.max_concurrent_loads == 4 and default.loader_processes is None
    ((_, p),) = grid(
        PointConfig(device="cpu"), parse_sweep(["max_concurrent_loads=8", "loader_processes=0"])
    )
    cfg = engine_config(p, {})
    assert cfg.max_concurrent_loads == 8 and cfg.loader_processes == 0
    points = grid(PointConfig(max_cpu_loras=16), {"max_loras": [8, 32]})
    assert [p.max_cpu_loras for _, p in points] == [16, 32]  # bumped to back every slot
    assert (
        label_of({"max_loras": 8, "targets": ("q_proj", "v_proj")})
        == "max_loras-8_targets-q_proj+v_proj"
    )
    for bad in (["nope=1"], ["max_loras"], ["max_loras=x"]):
        with pytest.raises(ValueError):
            parse_sweep(bad)


def test_adapter_eviction_is_a_point_field_flag_and_sweep_key() -> None:
    from loraplex.engine.bench.coldload.config import EVICTIONS
    from loraplex.engine.bench.coldload.run import engine_config
    from loraplex.engine.config import ADAPTER_EVICTIONS

    assert EVICTIONS == ADAPTER_EVICTIONS
    assert engine_config(PointConfig(device="cpu"), {}).adapter_eviction == "lru"
    sweep = parse_sweep(["adapter-eviction=lru,gdf"])
    assert sweep == {"adapter_eviction": ["lru", "gdf"]}
    points = grid(PointConfig(device="cpu"), sweep)
    assert [engine_config(p, {}).adapter_eviction for _, p in points] == ["lru", "gdf"]
    assert label_of(points[1][0]) == "adapter_eviction-gdf"
    with pytest.raises(ValueError, match="'arc'"):
        parse_sweep(["adapter_eviction=lru,arc"])  # before any point runs
    with pytest.raises(ValueError, match="adapter_eviction"):
        PointConfig(adapter_eviction="arc")
    p = argparse.ArgumentParser()
    coldload_cli.add_arguments(p)
    args = p.parse_args(["--adapter-eviction", "gdsf"])
    assert coldload_cli.point_from_args(args).adapter_eviction == "gdsf"
    assert coldload_cli.point_from_args(p.parse_args([])).adapter_eviction == "lru"


def test_eviction_ab_runs_one_trace_per_policy(tmp_path: Path) -> None:
    sweep = parse_sweep(["adapter_eviction=lru,gdf"])
    study = run_study(_point(), tmp_path, sweep=sweep, progress=False, quiet=True)
    lru, gdf = study.results
    assert (lru.label, gdf.label) == ("adapter_eviction-lru", "adapter_eviction-gdf")
    for res in (lru, gdf):
        doc = _check_point_dir(tmp_path / "points" / res.label)
        _check_consistent(doc)
        assert doc["config"]["adapter_eviction"] == res.values["adapter_eviction"]
    # the same arrivals at both points: only the policy differs
    assert [q["adapter"] for q in lru.requests] == [q["adapter"] for q in gdf.requests]


def test_warm_yardstick_serves_the_same_trace_without_cold_loads(tmp_path: Path) -> None:
    study = run_study(_point(warm_yardstick=True), tmp_path, progress=False, quiet=True)
    (res,) = study.results
    cold = _check_point_dir(tmp_path)
    _check_consistent(cold)
    warm = json.loads((tmp_path / "warm" / "result.json").read_text())
    # the same arrivals, every adapter already in the CPU tier: no miss, no fetch
    assert [r["adapter"] for r in warm["requests"]] == [r["adapter"] for r in cold["requests"]]
    assert warm["summary"]["tiers"]["counts"]["cold"] == 0
    assert warm["summary"]["engine"]["adapters"]["misses"] == 0
    assert warm["summary"]["loads"]["count"] == 0
    used = {r["adapter"] for r in cold["requests"] if r["adapter"]}
    assert warm["config"]["max_cpu_loras"] == FAST["max_cpu_loras"]  # the point as given
    assert warm["engine"]["cpu_tier_adapters"] >= len(used)
    y = res.summary["yardstick"]
    assert y["warm_misses"] == 0
    assert y["warm_itl"]["n"] == cold["summary"]["itl"]["all"]["n"] > 0
    assert y["ratio_p99"] == pytest.approx(
        cold["summary"]["itl"]["all"]["p99_s"] / warm["summary"]["itl"]["all"]["p99_s"]
    )
    assert "warm yardstick" in study.text
    # prefill steps of both runs side by side (bunched admissions vs slower steps)
    pre = y["prefill_steps"]
    assert pre["cold"] == cold["summary"]["prefill_steps"]
    assert pre["warm"] == warm["summary"]["prefill_steps"]
    for side in (pre["cold"], pre["warm"]):
        assert side["n"] > 0 and side["tokens_max"] >= side["tokens_p50"] > 0
        assert side["p99_s"] >= side["p50_s"] > 0
    assert "prefill steps cold/warm: n " in study.text
    lo, hi = y["ratio_p99_interval"]
    assert 0 < lo <= hi
    assert "95 % interval" in study.text
    b = cold["summary"]["backlog"]
    assert len(b["windows"]) == 3 and b["loads_per_s"] > 0
    assert "load path: " in study.text


def test_ratio_interval_brackets_the_ratio_and_moves_with_it() -> None:
    from loraplex.engine.bench.coldload.metrics import ratio_interval

    g = random.Random(3)
    # 60 s of steps: ~6 ms decodes, a slow prefill step now and then, 8 streams per step
    warm, t = [], 0.0
    while t < 60:
        d = 0.006 if g.random() > 0.03 else g.uniform(0.02, 0.04)
        t += d
        warm += [(t, d, False)] * 8
    same = ratio_interval(warm, warm)
    assert same == (1.0, 1.0)
    slower = [(t, d * 1.2, w) for t, d, w in warm]
    lo, hi = ratio_interval(slower, warm)
    assert lo == pytest.approx(1.2) and hi == pytest.approx(1.2)
    other, t = [], 0.0  # the same process, other coincidences: an interval around 1
    while t < 60:
        d = 0.006 if g.random() > 0.03 else g.uniform(0.02, 0.04)
        t += d
        other += [(t, d, False)] * 8
    lo, hi = ratio_interval(other, warm)
    assert lo < 1.0 < hi and hi - lo < 0.6
    assert ratio_interval([], warm) is None


def _cold_rows(times: list[float], waits: list[float]) -> list[dict[str, Any]]:
    return [
        {"t_arrival": t, "tier": "cold", "ttft_s": w + 0.01, "prefill_s": 0.01, "error": None}
        for t, w in zip(times, waits, strict=True)
    ]


def test_backlog_tells_a_load_path_that_keeps_up_from_a_growing_queue() -> None:
    from loraplex.engine.bench.coldload.collect import LoadRecord
    from loraplex.engine.bench.coldload.metrics import backlog

    t0 = 100.0
    times = [0.1 * i for i in range(300)]  # 10 cold requests/s for 30 s

    def loads(waits: list[float]) -> list[LoadRecord]:
        return [
            LoadRecord(f"a{i}", "d", True, t0 + t + w, w, 1, True, {"stage": w})
            for i, (t, w) in enumerate(zip(times, waits, strict=True))
        ]

    steady = [0.05] * len(times)  # every load 50 ms: about half a request waiting at a time
    b = backlog(_cold_rows(times, steady), loads(steady), t0, 30.0)
    assert b["sustained"] is True
    assert b["loads_per_s"] == pytest.approx(10.0, abs=0.2)
    assert [w["cold_arrived"] for w in b["windows"]] == [100, 100, 100]
    assert all(w["waiting_mean"] == pytest.approx(0.5, abs=0.1) for w in b["windows"])

    # loads served one at a time at 8/s against 10 arrivals/s: the queue grows all along
    growing, free = [], 0.0
    for t in times:
        free = max(free, t) + 0.125
        growing.append(free - t)
    b = backlog(_cold_rows(times, growing), loads(growing), t0, 30.0)
    assert b["sustained"] is False
    w = b["windows"]
    assert w[0]["waiting_mean"] < w[1]["waiting_mean"] < w[2]["waiting_mean"]
    assert w[2]["cold_ttft_p50_s"] > 2 * w[0]["cold_ttft_p50_s"]

    # a cold request that never got its token is not a sustained rate, whatever the means say
    rows = _cold_rows(times, steady)
    rows[-1]["ttft_s"] = None
    assert backlog(rows, loads(steady), t0, 30.0)["sustained"] is False
