"""The CPU base layout (``set_base_layout(transposed=True)``): same values, same outputs as the
row-major layout, A rows and slot writes untouched, and it goes back."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.layers import LoRALinear
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model_runner import ModelRunner, StepItem
from tests.helpers.models import make_tiny_model


@pytest.mark.parametrize("bias", [False, True])
def test_linear_transposed_matches_row_major(bias):
    g = torch.Generator().manual_seed(0)
    lin = LoRALinear(
        24, {"q": 16, "k": 8}, bias=bias, max_loras=2, max_rank=4, dtype=torch.float32,
        device="cpu",
    )  # fmt: skip
    with torch.no_grad():
        lin.weight_aug.copy_(torch.randn(lin.weight_aug.shape, generator=g))
        if bias:
            lin.bias_aug.copy_(torch.randn(lin.bias_aug.shape, generator=g))
        lin.lora_b.copy_(torch.randn(lin.lora_b.shape, generator=g))
    w, a = lin.weight.clone(), lin.lora_a.clone()
    x = torch.randn(5, 24, generator=g)
    mapping = LoRAMapping.build([-1, 0, 0, 1, 1], [4, 3])
    ref = lin(x, mapping)
    lin.set_base_layout(True)
    assert torch.equal(lin.weight, w) and torch.equal(lin.lora_a, a)
    torch.testing.assert_close(lin(x, mapping), ref, atol=1e-5, rtol=1e-5)
    lin.set_base_layout(False)
    assert lin.weight.is_contiguous() and torch.equal(lin.weight, w)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied and tied embeddings
def test_runner_layout_keeps_values(tmp_path, kind):
    model = load_model(make_tiny_model(tmp_path, kind=kind), dtype=torch.float32, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    items = [StepItem([5, 7, 9], 0, [0]), StepItem([3], 0, [1])]
    ref = ModelRunner(model, num_blocks=4, block_size=4).execute(items)  # transposed layout
    assert model.layers[0].qkv_proj.base_transposed
    assert not model.lm_head.is_contiguous()
    for k, v in model.state_dict().items():
        if not k.endswith("weight_aug"):  # its base rows hold W^T's bytes
            assert torch.equal(v, before[k]), k
    model.set_base_layout(False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.compute_logits(torch.ones(1, 64)).shape == (1, 256)
    out = ModelRunner(model, num_blocks=4, block_size=4).execute(items)
    torch.testing.assert_close(out, ref)
