"""RoPE: ``apply_rotary`` on a per-step table vs ``RotaryEmbedding.forward``; RMSNorm's fp32
kernel vs its formula."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.llama import RMSNorm
from loraplex.engine.model.rope import RotaryEmbedding, apply_rotary

SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_apply_rotary_matches_forward(scaling):
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(32, 128, 10000.0, SCALINGS[scaling], "cpu")
    pos = torch.tensor([0, 5, 3, 127, 64, 1])
    q = torch.randn(6, 4, 32, generator=g)
    k = torch.randn(6, 2, 32, generator=g)
    q_ref, k_ref = rope(pos, q, k)
    qk = apply_rotary(torch.cat([q, k], dim=1), *rope.table(pos, torch.float32))
    torch.testing.assert_close(qk[:, :4], q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qk[:, 4:], k_ref, atol=1e-6, rtol=1e-6)


def test_rmsnorm_kernel_matches_formula():
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(48, 1e-5, torch.float32, "cpu")
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(48, generator=g))
    x = 3 * torch.randn(7, 48, generator=g)
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=1e-6)
