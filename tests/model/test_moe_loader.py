"""MoE configs and checkpoints: the config fields (sparse layers, expert counts, typed refusals),
the per-expert on-disk layout transformers saves and the fused form loading into the same
tensors, checkpoints that do not fit the config, and tensor parallelism refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.model.config import ModelConfig, ModelConfigError
from loraplex.engine.model.loader import ModelLoadError, load_model
from loraplex.engine.model.moe.model import MoeForCausalLM
from loraplex.engine.model.tp import TensorParallelError, TPShard, shard_config
from tests.helpers.models import TINY_CONFIG
from tests.helpers.moe_models import MOE_KINDS, fuse_experts, make_tiny_moe

pytest.importorskip("transformers")


def qwen3_fields(**kw) -> dict:
    fields = dict(
        TINY_CONFIG, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        num_hidden_layers=6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    )  # fmt: skip
    return {**fields, **kw}


def test_sparse_layers_follow_mlp_only_layers_and_the_step():
    cfg = ModelConfig.from_dict(qwen3_fields(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe is not None and cfg.qk_norm
    assert cfg.moe.sparse_layers == (1, 5)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_size) == (8, 2, 16)
    assert not cfg.moe.renormalize and not cfg.moe.fp32_weights
    shapes = cfg.adapter_module_shapes()
    assert (1, "q_proj") in shapes and (1, "gate_proj") not in shapes
    assert shapes[(0, "gate_proj")] == (64, TINY_CONFIG["intermediate_size"])  # a dense layer
    # transformers saves Qwen3-MoE's num_experts as num_local_experts
    saved = qwen3_fields()
    saved["num_local_experts"] = saved.pop("num_experts")
    assert ModelConfig.from_dict(saved).moe.num_experts == 8


def test_mixtral_config():
    cfg = ModelConfig.from_dict(
        dict(
            TINY_CONFIG,
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip
    )
    assert cfg.moe is not None and not cfg.qk_norm
    assert cfg.moe.sparse_layers == (0, 1) and cfg.moe.renormalize and cfg.moe.fp32_weights
    assert cfg.moe.expert_size == TINY_CONFIG["intermediate_size"]
    assert not any(
        m in ("gate_proj", "up_proj", "down_proj") for _, m in cfg.adapter_module_shapes()
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(mlp_only_layers="all"), "mlp_only_layers"),
        (dict(moe_intermediate_size="16"), "moe_intermediate_size"),
    ],
)
def test_bad_moe_configs_are_typed_errors(change, match):
    with pytest.raises(ModelConfigError, match=match):
        ModelConfig.from_dict(qwen3_fields(**change))


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def model_dir(request, tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp(request.param) / "base", request.param, seed=2)


def _load(path) -> MoeForCausalLM:
    model = load_model(path, dtype=torch.float32, device="cpu", max_loras=2, max_lora_rank=4)
    assert isinstance(model, MoeForCausalLM)
    return model


def test_per_expert_layout_loads(model_dir):
    model = _load(model_dir)
    disk = load_file(model_dir / "model.safetensors")
    mixtral = model.cfg.model_type == "mixtral"
    parent = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    checked = 0
    for i, layer in enumerate(model.layers):
        if layer.mlp is None:
            assert f"model.layers.{i}.mlp.gate_proj.weight" in disk  # Qwen3's dense layer
            continue
        block, i_size = layer.mlp, layer.mlp.spec.expert_size
        assert torch.equal(block.router, disk[f"model.layers.{i}.{parent}.gate.weight"])
        for e in range(block.spec.num_experts):
            key = f"model.layers.{i}.{parent}.experts.{e}"
            assert torch.equal(block.w_gate_up[e, :i_size], disk[f"{key}.{names[0]}.weight"])
            assert torch.equal(block.w_gate_up[e, i_size:], disk[f"{key}.{names[1]}.weight"])
            assert torch.equal(block.w_down[e], disk[f"{key}.{names[2]}.weight"])
            checked += 1
    assert checked >= 8


def test_fused_layout_loads_the_same_tensors(model_dir, tmp_path):
    fused = shutil.copytree(model_dir, tmp_path / "fused")
    fuse_experts(fused)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(fused / "model.safetensors"))
    a, b = _load(model_dir), _load(fused)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def _with_experts(model_dir, tmp_path, n: int):
    bad = shutil.copytree(model_dir, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_local_experts"] = n
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_checkpoints_with_other_expert_counts_are_refused(model_dir, tmp_path):
    experts = json.loads((model_dir / "config.json").read_text())["num_local_experts"]
    with pytest.raises(ModelLoadError, match=f"expert {experts - 1}, config has {experts - 1}"):
        _load(_with_experts(model_dir, tmp_path / "fewer", experts - 1))
    # the router's rows tell first (its key sorts after the experts')
    with pytest.raises(ModelLoadError, match=rf"gate.weight: .*\({experts}, 64\) != expected"):
        _load(_with_experts(model_dir, tmp_path / "more", experts + 1))


def test_tensor_parallelism_is_refused(model_dir):
    """Where the engine checks a model splits (parallel/group.py, before any worker starts;
    the memory estimate of --dry-run), and on the model itself."""
    cfg = ModelConfig.from_dir(model_dir)
    with pytest.raises(TensorParallelError, match="mixture-of-experts .* tensor_parallel_size 1"):
        shard_config(cfg, TPShard(0, 2))
    assert shard_config(cfg, TPShard(0, 1)) is cfg
    model = _load(model_dir)
    with pytest.raises(TensorParallelError, match="not split over ranks"):
        model.set_tensor_parallel(None)  # type: ignore[arg-type]


def test_a_missing_expert_is_refused(model_dir, tmp_path):
    bad = shutil.copytree(model_dir, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    gone = [k for k in tensors if k.startswith("model.layers.0.") and ".experts.1." in k]
    gone = [k for k in gone if k.endswith(("down_proj.weight", "w2.weight"))]
    assert len(gone) == 1
    del tensors[gone[0]]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks weights for: layers.0.mlp.w_down"):
        _load(bad)
