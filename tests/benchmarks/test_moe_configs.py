"""The MoE decode launch sweep (benchmarks/moe_configs.py) on CPU under the Triton
interpreter: the script runs, and the configurations it may pick compute the torch twin's
result (a config that does not is skipped by the sweep, never timed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from benchmarks import moe_configs as sweep
from loraplex.engine.model.moe.triton_expert_lora import expert_lora_config


def test_smoke_prints_a_row_per_module() -> None:
    lines = sweep.main(["--smoke"])
    rows = [line for line in lines if line.startswith(("| gate_up", "| down", "| base_"))]
    assert [r.split("|")[1].strip() for r in rows] == list(sweep.MODULES)
    assert all("block_k" in r for r in rows)


@pytest.mark.parametrize("module", ["gate_up", "down"])
@pytest.mark.parametrize(
    "tiles",
    [dict(block_c=16, block_k=128), dict(block_k=32, block_n=32), dict(block_n=128, num_stages=3)],
)
def test_other_tiles_compute_the_twins_delta(module: str, tiles: dict) -> None:
    case = sweep.case_tensors(module, 3, 3, 8, sweep.SMOKE_SHAPE, 1, "cpu", torch.float32)
    cols = case["weights"][0][0].shape[2]
    cfg = replace(expert_lora_config(case["blocks"].block_m, cols), **tiles)
    assert sweep.check_config(case, cfg) < 1e-5


@pytest.mark.parametrize("module", ["base_gate_up", "base_down"])
@pytest.mark.parametrize("tiles", [dict(block_n=32, block_k=128), dict(block_k=32, num_stages=3)])
def test_other_grouped_tiles_compute_the_twins_product(module: str, tiles: dict) -> None:
    from loraplex.engine.model.moe.triton_grouped import grouped_config

    case = sweep.case_tensors(module, 3, 3, 8, sweep.SMOKE_SHAPE, 1, "cpu", torch.float32)
    w = case["weights"][0]
    cfg = replace(grouped_config(case["blocks"].block_m, w.shape[1], w.shape[2], 4), **tiles)
    assert sweep.check_config(case, cfg) < 1e-5


def test_a_launch_that_computes_something_else_is_told(monkeypatch) -> None:
    import loraplex.engine.model.moe.triton_expert_lora as kernels

    case = sweep.case_tensors("down", 3, 3, 8, sweep.SMOKE_SHAPE, 1, "cpu", torch.float32)
    cfg = expert_lora_config(case["blocks"].block_m, case["weights"][0][0].shape[2])
    real = kernels.expert_lora_triton

    def off_by_a_bit(*args, **kw):
        real(*args, **kw)
        args[6][0] += 1e-3  # out: one pair's row moved

    monkeypatch.setattr(kernels, "expert_lora_triton", off_by_a_bit)
    assert sweep.check_config(case, cfg) > 1e-5
