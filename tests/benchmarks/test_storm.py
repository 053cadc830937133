"""The storm benchmark's CPU smoke mode: windows in order, gaps measured, ratios against the
quiet window before each load window, loads and slot writes reported."""

from __future__ import annotations

import json

from benchmarks import storm
from benchmarks.storm.run import writes_during


def test_storm_smoke(tmp_path) -> None:
    out = tmp_path / "storm.json"
    result = storm.main(
        [
            "--smoke", "--storms", "3", "--workdir", str(tmp_path / "work"), "--out", str(out),
            "--plot", str(tmp_path / "timeline.png"), "--sustained", "20", "0.5",
        ]
    )  # fmt: skip
    names = [r["window"] for r in result["rows"]]
    assert names == [
        "quiet", "register 3", "settle 3", "requests 3", "after 3", "before sustained",
        "sustained 20/s",
    ]  # fmt: skip
    rows = {r["window"]: r for r in result["rows"]}
    assert rows["quiet"]["gaps"] > 10 and rows["requests 3"]["gaps"] > 0
    for name in ("register 3", "requests 3"):
        r = rows[name]
        assert r["reference"] == names[names.index(name) - 1]
        assert r["p99_vs_quiet"] > 0 and r["max_vs_quiet_p50"] > 0
    # one load per storm adapter: at registration while the CPU tier has room, else at the
    # first request
    load_rows = [rows[w] for w in ("register 3", "requests 3") if "loads" in rows[w]]
    assert sum(r["loads"] for r in load_rows) == 3
    assert all(r["failed_loads"] == 0 and r["stage_p50_ms"] > 0 for r in load_rows)
    assert rows["requests 3"]["ttft_max_s"] >= rows["requests 3"]["ttft_p50_s"] > 0
    # registrations at a fixed rate with no requests: each its own load, ratios against the
    # window before (the storms' adapters removed first, so each finds room for its image)
    steady = rows["sustained 20/s"]
    assert steady["reference"] == "before sustained" and steady["p99_vs_quiet"] > 0
    assert steady["sustained"]["sent"] == 10 and steady["sustained"]["failed"] == 0
    assert steady["loads"] == 10 and steady["failed_loads"] == 0
    assert "10 images packed" in storm.table(result)
    assert result["compiles_while_serving"] == 0
    assert json.loads(out.read_text())["rows"][0]["window"] == "quiet"
    assert "| requests 3 |" in storm.table(result)
    slow = rows["requests 3"]["slowest_steps"]
    assert slow and all(isinstance(e["writes_in_flight"], list) for e in slow)
    assert "in flight" in storm.table(result)
    tl = result["timeline"]
    assert [w[0] for w in tl["windows"]] == names and len(tl["loads"]) >= 3
    assert tl["steps"] and all(b >= a for a, b in zip(tl["steps"], tl["steps"][1:], strict=False))
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_storm_smoke_on_a_moe_shape(tmp_path) -> None:
    """``--shape qwen3-30b-a3b`` (its tiny twin here): the adapters carry LoRA on every expert
    (PEFT's target_parameters form) and load through the same path, none failing."""
    result = storm.main(
        ["--smoke", "--shape", "qwen3-30b-a3b", "--storms", "3", "--workdir", str(tmp_path / "w")]
    )
    assert result["shape"]["moe"] and result["shape"]["layers"] == 3
    config = json.loads((tmp_path / "w/adapters/s3_0/adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    rows = {r["window"]: r for r in result["rows"]}
    load_rows = [rows[w] for w in ("register 3", "requests 3") if "loads" in rows[w]]
    assert sum(r["loads"] for r in load_rows) == 3
    assert all(r["failed_loads"] == 0 for r in load_rows)
    assert rows["requests 3"]["ttft_max_s"] > 0 and result["compiles_while_serving"] == 0
    from safetensors import safe_open

    from benchmarks.moe_decode import TINY

    with safe_open(tmp_path / "w/adapters/s3_0/adapter_model.safetensors", "pt") as f:
        a = f.get_slice("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight")
        b = f.get_slice("base_model.model.model.layers.0.mlp.experts.lora_B.weight")
        rows_e = 8 * TINY["num_experts"]  # rank 8 (the smoke's) per expert
        assert a.get_shape() == [rows_e, TINY["hidden_size"]]  # gate_up: in H
        assert b.get_shape() == [TINY["hidden_size"], rows_e]  # down: out H


def test_writes_during_names_the_slot_writes_that_overlap_a_step() -> None:
    """A write spans (its event's time - h2d_s, its event's time), relative to the step."""
    writes = [(10.0, {"h2d_s": 0.005, "h2d_gpu_s": 0.002}), (20.0, {"h2d_s": 0.001})]
    assert writes_during(writes, 9.998, 10.010) == [{"from_ms": -3.0, "to_ms": 2.0, "gpu_ms": 2.0}]
    assert writes_during(writes, 10.001, 10.002) == []  # landed before the step began
    assert writes_during(writes, 19.9, 19.998) == []  # issued after it ended
    assert writes_during(writes, 19.9, 20.1)[0]["gpu_ms"] == 0.0
