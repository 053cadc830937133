"""Start-up with a caller-supplied model: its LoRA slots must match the config (slot count
``max_loras``, slot rank ``max_lora_rank``); a matching one serves like the checkpoint."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.model.loader import load_model
from loraplex.engine.startup import build_core, capacity_report
from tests.helpers.engine import assert_idle, collect, config, register


def model_of(model_dir, *, max_loras: int, max_lora_rank: int):
    return load_model(
        model_dir,
        dtype=torch.float32,
        device="cpu",
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
    )


@pytest.mark.parametrize(
    ("slots", "rank", "message"),
    [
        (4, 16, r"the model has 4 LoRA slots but the config asks for max_loras=2"),
        (2, 8, r"rank 8 but the config asks for max_lora_rank=16"),
        (0, 16, r"the model has 0 LoRA slots but the config asks for max_loras=2"),
    ],
)
def test_supplied_model_with_other_slots_is_refused(tiny, slots, rank, message):
    model_dir, _ = tiny
    model = model_of(model_dir, max_loras=slots, max_lora_rank=rank)
    with pytest.raises(ValueError, match=message):
        build_core(config(model_dir, max_loras=2, max_lora_rank=16), lambda: None, model)


async def test_engine_start_refuses_a_mismatched_model(tiny):
    model_dir, _ = tiny
    model = model_of(model_dir, max_loras=2, max_lora_rank=8)
    engine = AsyncEngine(config(model_dir, max_loras=2, max_lora_rank=16), model=model)
    try:
        with pytest.raises(ValueError, match="max_lora_rank=16"):
            await engine.start()
    finally:
        await engine.close()


async def test_supplied_model_serves_like_the_checkpoint(tiny):
    model_dir, adapters = tiny
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cfg = config(model_dir, max_loras=2, max_lora_rank=16)
    outs = []
    for model in (None, model_of(model_dir, max_loras=2, max_lora_rank=16)):
        async with AsyncEngine(cfg, model=model) as engine:
            await register(engine, adapters)
            outs.append([(await collect(engine, [5, 9, 14], params, adapter=a))[0]
                         for a in (None, "sql", "poem")])  # fmt: skip
            assert_idle(engine)
    assert outs[0] == outs[1]


async def test_a_model_without_slots_has_no_rank_to_match(tiny):
    model_dir, _ = tiny
    model = model_of(model_dir, max_loras=0, max_lora_rank=8)
    cfg = config(model_dir, max_loras=0, max_cpu_loras=0, max_lora_rank=16)
    async with AsyncEngine(cfg, model=model) as engine:
        tokens, _, _ = await collect(engine, [5, 9], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(tokens) == 2 and engine.capacity_report()["gpu_slots"] == 0


async def test_supplied_moe_model_with_other_expert_slots_is_refused(tmp_path):
    """A MoE model built with expert storage for 1 slot, a config that asks for 2 (or for the
    default, every slot): refused with the field to change; a matching one starts, and its
    capacity report counts the expert-capable slots and their bytes."""
    from loraplex.engine.model.moe.expert_lora import ExpertLoRA
    from tests.helpers.moe_models import make_tiny_moe

    folder = make_tiny_moe(tmp_path / "moe", "qwen3_moe", seed=1)
    model = load_model(folder, dtype=torch.float32, device="cpu", max_loras=3, max_lora_rank=4,
                       max_expert_loras=1)  # fmt: skip
    for asked in (2, None):
        cfg = config(folder, max_loras=3, max_lora_rank=4, max_expert_loras=asked)
        with pytest.raises(ValueError, match=r"1 expert-capable LoRA slots .* max_expert_loras"):
            build_core(cfg, lambda: None, model)
    core = build_core(
        config(folder, max_loras=3, max_lora_rank=4, max_expert_loras=1), lambda: None, model
    )
    try:
        cap = capacity_report(core)
    finally:
        await core.close()
    blocks = [m for m in model.modules() if isinstance(m, ExpertLoRA)]
    assert cap["expert_slots"] == 1 and blocks
    assert cap["expert_slot_bytes"] == sum(b.slot_bytes for b in blocks)
    assert cap["gpu_slots"] == 3


async def test_a_dense_model_reports_no_expert_slots(tiny):
    model_dir, _ = tiny
    core = build_core(config(model_dir), lambda: None, None)
    try:
        assert "expert_slots" not in capacity_report(core)
    finally:
        await core.close()
