"""BLAS backend per GEMM shape (engine/model/gemm.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.model import gemm


def test_untuned_shapes_and_cpu_are_plain_linear():
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    gemm.tune([w], 3)  # CPU weights: nothing to tune
    assert (3, 5, 8) not in gemm.choices()
    torch.testing.assert_close(gemm.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)


@pytest.mark.gpu
def test_tuned_linear_matches_each_backend_and_restores_the_preference():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1536, 1024, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(64, 1024, device="cuda", generator=g).to(torch.bfloat16)
    before = torch.backends.cuda.preferred_blas_library()
    gemm.tune([w], 64)
    assert gemm.choices()[(64, 1536, 1024)] in gemm.BACKENDS
    got = gemm.linear(x, w)
    assert torch.backends.cuda.preferred_blas_library() == before
    want = (x.float() @ w.float().T).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_tuning_times_the_weight_from_hbm():
    """The timing evicts the L2 before each call and subtracts the evictions: a weight that
    fits the L2 times slower cold than warm, and neither time is the eviction's."""
    dev = torch.device("cuda")
    flush = gemm._l2_flusher(dev)
    assert flush is not None
    w = torch.randn(4096, 2048, device=dev).to(torch.bfloat16)  # 16 MB: fits the L2
    x = torch.randn(32, 2048, device=dev).to(torch.bfloat16)
    warm = min(gemm._time_ms(lambda: F.linear(x, w), 10) for _ in range(3))
    cold = min(gemm._time_ms(lambda: F.linear(x, w), 10, flush) for _ in range(3))
    flush_alone = gemm._time_ms(flush, 10)
    assert 0 < warm < cold < flush_alone
