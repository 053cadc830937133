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


@pytest.fixture
def interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_candidate_matches_linear(interpret, dtype):
    """The split-K GEMM as a backend: every candidate config (heuristic, 1-8 way splits) gives
    F.linear's result, bias included; a non-contiguous x is taken too."""
    g = torch.Generator().manual_seed(1)
    t, n, k = 5, 96, 1024
    w = (torch.randn(n, k, generator=g) / k**0.5).to(interpret, dtype)
    b = torch.randn(n, generator=g).to(interpret, dtype)
    x = torch.randn(t, 2 * k, generator=g).to(interpret, dtype)[:, ::2]  # strided along K
    want = F.linear(x.float(), w.float(), b.float())
    cfgs = gemm.triton_configs(t, n, k)
    assert {c.split_k for c in cfgs} >= {1, 2, 4}
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for cfg in cfgs:
        got = gemm.triton_linear(x, w, cfg, b)
        assert got.shape == (t, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(gemm.triton_linear(x, w, cfg).float(), want - b.float(),
                                   rtol=tol, atol=tol)  # fmt: skip


def test_triton_candidate_is_for_decode_sizes():
    w = torch.empty(64, 128, dtype=torch.bfloat16)
    assert gemm._triton_allowed(w, 1) and gemm._triton_allowed(w, gemm.TRITON_MAX_TOKENS)
    assert not gemm._triton_allowed(w, gemm.TRITON_MAX_TOKENS + 1)
    assert not gemm._triton_allowed(w.float(), 8)  # float32 weights: cuBLAS only
    assert not gemm._triton_allowed(w.t(), 8)  # K not contiguous


def test_triton_tuning_skips_configs_the_device_cannot_take(monkeypatch):
    """A config whose shared memory exceeds the device's (Triton's OutOfResources at launch)
    is left out of the tuning, not raised: the H200 refused one of the 256-wide K tiles."""
    from triton.runtime.errors import OutOfResources

    from loraplex.engine.model.kernels import fp8_linear

    w = torch.empty(64, 1024, dtype=torch.bfloat16)
    cfgs = gemm.triton_configs(32, 64, 1024)
    assert len(cfgs) >= 3
    times = {cfgs[0]: OutOfResources(262144, 232448, "shared memory"), cfgs[1]: 2.0}

    def fake_time(fn, reps, flush):
        cfg = fn.__defaults__[0]
        t = times.get(cfg, 3.0)
        if isinstance(t, Exception):
            raise t
        return t

    monkeypatch.setattr(gemm, "_time_ms", fake_time)
    monkeypatch.setattr(fp8_linear, "prepare_fp8_linear", lambda device: None)
    cfg, ms = gemm._tune_triton(torch.empty(32, 1024, dtype=torch.bfloat16), w, 1, None)
    assert (cfg, ms) == (cfgs[1], 2.0)

    # every config refused: no candidate, the BLAS backends decide
    def refuse(fn, reps, flush):
        raise OutOfResources(262144, 232448, "shared memory")

    monkeypatch.setattr(gemm, "_time_ms", refuse)
    x = torch.empty(32, 1024, dtype=torch.bfloat16)
    assert gemm._tune_triton(x, w, 1, None) == (None, float("inf"))


@pytest.mark.gpu
def test_tuned_triton_choice_runs_in_linear_and_in_a_graph():
    """A shape tuned to the split-K GEMM runs it through ``linear``, also captured in a CUDA
    graph (its counters were allocated at tune time); the result matches cuBLAS's closely."""
    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(4608, 4096, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    x = torch.randn(32, 4096, device="cuda", generator=g).to(torch.bfloat16)
    gemm.tune([w], 32)
    key = (32, 4608, 4096)
    assert gemm.choices()[key] in (*gemm.BACKENDS, "triton")
    assert key in gemm._triton_cfg  # the candidate was timed
    chosen = gemm._choice[key]
    try:
        gemm._choice[key] = "triton"
        eager = gemm.linear(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gemm.linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
    finally:
        gemm._choice[key] = chosen
    assert torch.equal(eager, captured)  # split-K sums in split order: deterministic
    want = F.linear(x, w)
    torch.testing.assert_close(eager.float(), want.float(), rtol=2e-2, atol=2e-2)
