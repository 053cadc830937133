"""The expert half of a slot write as one scatter (model/moe/expert_writes.py) against the
per-module writes (``ExpertLoRA.set``, the twin): the same slot bytes and ranks, for both adapter
layouts, rewrites of a slot with another layout, and attention-only adapters after expert ones;
the scatter under the Triton interpreter on CPU (the device kernel on CUDA)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.slot_buffers import SlotBuffers, write_slot
from loraplex.engine.model.moe.expert_lora import ExpertLoRA
from tests.helpers.models import make_peft_adapter
from tests.helpers.moe_models import MOE_KINDS, make_expert_adapter, make_tiny_moe, to_per_expert

pytest.importorskip("peft")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RANK = 8


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def moe(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_tiny_moe(root / "base", kind, seed=1)
    fused = make_expert_adapter(
        model_dir, root / "fused", r=4, alpha=8, target_modules=["q_proj", "o_proj"], seed=11
    )
    twin = make_expert_adapter(model_dir, root / "twin", r=RANK, alpha=16, seed=12)
    adapters = {
        "fused": fused,
        "per": to_per_expert(twin, root / "per", kind),
        "attn": make_peft_adapter(model_dir, root / "attn", r=4, alpha=8, seed=10),
    }
    return model_dir, adapters


def _model(model_dir):
    return load_model(
        model_dir, dtype=torch.float32, device=DEVICE, max_loras=3, max_lora_rank=RANK
    )


def _state(model) -> list[torch.Tensor]:
    out = []
    for _, block in model.expert_loras():
        out += [block.a_gate_up, block.b_gate_up, block.a_down, block.b_down, block.ranks]
    return [t.cpu() for t in out]


# (slot, adapter): fused then per-expert into one slot (a rewrite with another layout), the
# per-expert form into a second, an attention-only adapter over the fused one
WRITES = [(1, "fused"), (2, "per"), (1, "per"), (0, "fused"), (0, "attn"), (2, "fused")]


def test_one_scatter_writes_the_bytes_of_the_per_module_writes(moe, monkeypatch):
    model_dir, paths = moe
    ref, got = _model(model_dir), _model(model_dir)
    adapters = {
        n: load_adapter(p, ref.cfg, max_lora_rank=RANK, name=n, dtype=torch.float32)
        for n, p in paths.items()
    }
    sets = []
    real_set = ExpertLoRA.set
    monkeypatch.setattr(
        ExpertLoRA, "set", lambda self, *a: (sets.append(a[0]), real_set(self, *a))[1]
    )
    for step, (slot, name) in enumerate(WRITES):
        write_slot(ref, slot, adapters[name], scatter="torch")
        n_sets = len(sets)
        write_slot(got, slot, adapters[name], scatter="triton")
        assert len(sets) == n_sets, "the scatter wrote through ExpertLoRA.set"
        for i, (a, b) in enumerate(zip(_state(ref), _state(got), strict=True)):
            assert torch.equal(a, b), f"write {step} ({name} into {slot}): tensor {i}"
    ranks = [block.ranks.tolist() for _, block in got.expert_loras()]
    assert all(r == [0, RANK, 4] for r in ranks), ranks  # attn: no experts; per: R; fused: 4
    assert any(float(t.abs().sum()) > 0 for t in _state(got)[:4])


def test_a_layout_makes_its_expert_plan_once(moe):
    model_dir, paths = moe
    model = _model(model_dir)
    adapter = load_adapter(
        paths["per"], model.cfg, max_lora_rank=RANK, name="per", dtype=torch.float32
    )
    buffers = SlotBuffers(model)
    buffers.write(0, adapter, scatter="triton")
    buffers.write(1, adapter, scatter="triton")
    plans = buffers._sites().expert_plans
    assert len(plans) == 1
    (plan,) = plans.values()
    assert plan.plan is not None and set(plan.ranks.values()) == {RANK}
    # one table row per contiguous run: far fewer rows than elements written
    written = sum(int(b.a_down[0].numel()) for _, b in model.expert_loras())
    assert plan.plan.nblocks < written
