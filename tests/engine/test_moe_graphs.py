"""What the CUDA graphs of a MoE model tune and capture, read on CPU: the GEMMs of its first
layer's projections (a sparse layer has no dense MLP projections) and the LM head."""

from __future__ import annotations

from types import SimpleNamespace

from loraplex.engine.cuda_graph import DecodeGraphs
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.loader import build_model
from tests.helpers.models import TINY_CONFIG


def test_decode_graphs_tune_the_projections_a_moe_layer_has():
    cfg = ModelConfig.from_dict(
        dict(
            TINY_CONFIG,
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=4,
            num_experts_per_tok=2,
        )  # fmt: skip
    )
    model = build_model(cfg, max_loras=2, max_lora_rank=4)
    weights = DecodeGraphs.gemm_weights(SimpleNamespace(model=model), 4)  # type: ignore[arg-type]
    layer = model.layers[0]
    want = [layer.qkv_proj.aug_rows(4)[0], layer.o_proj.aug_rows(4)[0], model.lm_head]
    assert [w.shape for w in weights] == [w.shape for w in want]
