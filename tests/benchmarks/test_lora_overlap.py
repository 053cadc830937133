"""benchmarks/lora_overlap.py: every variant it times computes what the engine's step computes.
On CPU the side-stream forks run in order; the outputs of the side form (shrink GEMM, fp32 delta,
add, epilogue without LoRA) must match today's fused epilogues, with
the Triton kernels (interpreted) and with their twins. A broken delta must be caught."""

from __future__ import annotations

import pytest
import torch

from benchmarks import lora_overlap
from benchmarks.synthetic import random_model
from loraplex.engine.model.lora.ops.expand_delta import ExpandDeltaConfig

TINY = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
}


def _model():
    model = random_model(TINY, max_loras=3, max_lora_rank=16, device="cpu", dtype=torch.float32)
    layer = model.layers[0]
    g = torch.Generator().manual_seed(1)
    for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        lin.lora_a.copy_(torch.randn(lin.lora_a.shape, generator=g) * 0.1)
        lin.lora_b.copy_(torch.randn(lin.lora_b.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("triton", [False, True])
def test_variants_compute_the_step(triton: bool) -> None:
    expand = {"s0": ExpandDeltaConfig(16, 32, 4, 0), "s3": ExpandDeltaConfig(16, 64, 4, 3)}
    diffs = lora_overlap.check(_model(), 8, triton_kernels=triton, tol=1e-4, expand=expand)
    assert set(diffs) == {
        f"{p} {v}"
        for p in ("qkv", "o", "gate_up", "down")
        for v in ("side", "side-serial", "side s0", "side s3")
    }


def test_a_wrong_delta_is_caught(monkeypatch) -> None:
    real = lora_overlap.lora_expand_delta

    def half(shrink, b, mapping, offsets, out):
        real(shrink, b, mapping, offsets, out)
        out.mul_(0.5)

    monkeypatch.setattr(lora_overlap, "lora_expand_delta", half)
    with pytest.raises(AssertionError, match="side"):
        lora_overlap.check(_model(), 8, triton_kernels=False, tol=1e-4)
