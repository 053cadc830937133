"""Expert LoRA adapters (issue 42, phase 2): PEFT's ``target_parameters`` form on the fused
experts and the per-expert ``target_modules`` form parse into the same per-expert pairs; bad
ones are refused by the preflight and the parser with a typed error naming the field."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.adapters.staging import stage_file, stage_packed
from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
)
from loraplex.engine.model.config import ModelConfig
from tests.helpers.models import copy_adapter, make_tiny_model, write_adapter
from tests.helpers.moe_models import MOE_KINDS, make_expert_adapter, make_tiny_moe, to_per_expert

pytest.importorskip("peft")

R = 4


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def moe(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_tiny_moe(root / "base", kind, seed=4)
    fused = make_expert_adapter(model_dir, root / "fused", r=R, target_modules=["q_proj"], seed=3)
    per = to_per_expert(fused, root / "per", kind)
    return kind, ModelConfig.from_dir(model_dir), fused, per


def _refused(folder, mc, error, field, max_rank=16):
    """Both the preflight and the parser refuse ``folder`` with ``error`` naming ``field``."""
    for check in (
        lambda: preflight(folder, mc, max_lora_rank=max_rank, max_bytes=None),
        lambda: load_adapter(folder, mc, max_lora_rank=max_rank),
    ):
        with pytest.raises(error) as e:
            check()
        assert e.value.field is not None and field in e.value.field, e.value


def test_both_layouts_parse_into_the_same_expert_pairs(moe):
    kind, mc, fused, per = moe
    e_count, width, h = mc.moe.num_experts, mc.moe.expert_size, mc.hidden_size
    f = load_adapter(fused, mc, max_lora_rank=8)
    p = load_adapter(per, mc, max_lora_rank=8)
    assert f.rank == p.rank == R
    gu, down = f.weights[(0, "experts.gate_up_proj")], f.weights[(0, "experts.down_proj")]
    assert gu.experts == down.experts == e_count
    assert tuple(gu.a.shape) == (R * e_count, h) and tuple(gu.b.shape) == (2 * width, R * e_count)
    assert tuple(down.a.shape) == (R * e_count, width)
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(e_count):
        g, u, d = (p.weights[(0, f"experts.{e}.{n}")] for n in names)
        assert g.experts == 1 and tuple(g.a.shape) == (R, h) and tuple(d.b.shape) == (h, R)
        # PEFT's layout: expert e's A rows e*r .. (e+1)*r, its B column j at j*E + e
        torch.testing.assert_close(g.a, gu.a[e * R : (e + 1) * R], rtol=0, atol=0)
        torch.testing.assert_close(u.a, gu.a[e * R : (e + 1) * R], rtol=0, atol=0)
        torch.testing.assert_close(g.b, gu.b[:width, e::e_count], rtol=0, atol=0)
        torch.testing.assert_close(u.b, gu.b[width:, e::e_count], rtol=0, atol=0)
        torch.testing.assert_close(d.b, down.b[:, e::e_count], rtol=0, atol=0)
    assert set(mc.moe.sparse_layers) == {k[0] for k in f.weights if k[1].startswith("experts")}


@pytest.mark.parametrize("form", ["fused", "per"])
def test_one_pass_stage_matches_the_parser(moe, form):
    """The cold-load pass packs the same image, bit for bit, as parse + pack."""
    kind, mc, fused, per = moe
    folder = fused if form == "fused" else per
    staged = stage_file(folder, mc, 8, dtype=torch.float32)
    packed = stage_packed(load_adapter(folder, mc, max_lora_rank=8), 8, pin=False)
    assert torch.equal(staged.image.buffer, packed.buffer)
    assert staged.rank == R
    assert staged.image.entries == packed.entries


def test_single_parameter_and_wrapping_order(moe, tmp_path):
    """Which key is which parameter follows the model's parameter order: with only down_proj
    targeted, ``experts.lora_*`` is down_proj; the config's list order does not matter."""
    kind, mc, fused, _ = moe
    base_dir = tmp_path / "m"
    model_dir = make_tiny_moe(base_dir, kind, seed=4)
    only = make_expert_adapter(
        model_dir, tmp_path / "down", r=R, target_parameters=["mlp.experts.down_proj"]
    )
    a = load_adapter(only, mc, max_lora_rank=8)
    assert {k[1] for k in a.weights} == {"experts.down_proj"}
    # the same file with the config's list reversed reads the same
    cfg_rev = copy_adapter(
        fused, tmp_path / "rev",
        target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],
    )  # fmt: skip
    b = load_adapter(cfg_rev, mc, max_lora_rank=8)
    assert tuple(b.weights[(0, "experts.gate_up_proj")].a.shape)[1] == mc.hidden_size


def test_expert_adapters_on_a_dense_model_are_refused(moe, tmp_path):
    kind, _, fused, per = moe
    dense = ModelConfig.from_dir(make_tiny_model(tmp_path / "dense", "llama"))
    _refused(fused, dense, AdapterTargetError, "target_parameters")
    # the per-expert form: Mixtral's w1 / w2 / w3 are no module of a dense base (the config
    # is refused); Qwen3-MoE's names are, and its per-expert tensors are refused by key
    field = "target_modules" if kind == "mixtral" else "experts."
    _refused(per, dense, AdapterTargetError, field)


def test_a_wrong_expert_count_is_refused(moe, tmp_path):
    kind, mc, fused, per = moe
    e_count = mc.moe.num_experts
    t = load_file(fused / "adapter_model.safetensors")
    grown = {}
    for k, v in t.items():
        if ".experts." in k and "lora_A" in k:
            v = torch.cat([v, v[:R]])  # one expert more
        elif ".experts." in k and "lora_B" in k:
            v = torch.cat([v, v[:, :R]], dim=1)
        grown[k] = v
    _refused(
        copy_adapter(fused, tmp_path / "grown", tensors=grown), mc, AdapterShapeError, "experts"
    )
    # the per-expert form naming an expert the base does not have
    t = load_file(per / "adapter_model.safetensors")
    extra = {k.replace(".experts.0.", f".experts.{e_count}."): v.clone() for k, v in t.items()
             if ".experts.0." in k}  # fmt: skip
    bad = copy_adapter(per, tmp_path / "extra", tensors={**t, **extra})
    _refused(bad, mc, AdapterTargetError, f"experts.{e_count}.")


def test_router_targets_are_refused(moe, tmp_path):
    kind, mc, fused, _ = moe
    router = copy_adapter(fused, tmp_path / "router", target_parameters=["mlp.gate.weight"])
    _refused(router, mc, AdapterTargetError, "target_parameters")
    gate = copy_adapter(fused, tmp_path / "gate", target_modules=["q_proj", "gate"])
    _refused(gate, mc, AdapterTargetError, "target_modules")
    # router LoRA tensors PEFT would save for a router target
    key = "base_model.model.model.layers.0.mlp.gate"
    t = {f"{key}.lora_A.weight": torch.zeros(R, mc.hidden_size),
         f"{key}.lora_B.weight": torch.zeros(mc.moe.num_experts, R)}  # fmt: skip
    cfg = dict(peft_type="LORA", r=R, lora_alpha=8, target_modules=["q_proj"])
    _refused(write_adapter(tmp_path / "rt", cfg, t), mc, AdapterTargetError, "mlp.gate")


def test_ranks_over_the_limit_and_mixed_layouts_are_refused(moe, tmp_path):
    kind, mc, fused, per = moe
    for name, src in (("fused", fused), ("per", per)):  # experts only: their rank is refused
        t = {
            k: v for k, v in load_file(src / "adapter_model.safetensors").items() if "experts" in k
        }
        only = copy_adapter(src, tmp_path / name, tensors=t)
        _refused(only, mc, AdapterRankError, "experts", max_rank=R - 1)
    both = {**load_file(fused / "adapter_model.safetensors"),
            **load_file(per / "adapter_model.safetensors")}  # fmt: skip
    names = ["w1", "w2", "w3"] if kind == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    mixed = copy_adapter(fused, tmp_path / "mixed", tensors=both, target_modules=["q_proj", *names])
    _refused(mixed, mc, AdapterFormatError, "experts")
    dora = copy_adapter(per, tmp_path / "dora", use_dora=True)
    _refused(dora, mc, AdapterConfigError, "use_dora")
