"""The W8A8 projection (kernels/fp8_w8a8.py): per-token quantization and the de-quantization of
the fp8 GEMM's float32 result, each Triton kernel against its torch twin bit for bit; the whole
projection against its twin and against the weight-only result. On CPU the kernels run in the
Triton interpreter (float32 / float16) and ``torch._scaled_mm`` on the CPU; bfloat16 and CUDA
graphs run on the GPU."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.kernels.fp8_linear import fp8_aug_linear_torch
from loraplex.engine.model.kernels.fp8_w8a8 import (
    FP8_MAX,
    dequant_cols,
    dequant_cols_torch,
    fp8_w8a8_linear,
    fp8_w8a8_linear_torch,
    quant_rows,
    quant_rows_torch,
    w8a8_supported,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + (
    [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if DEVICE == "cuda" else []
)
FP8 = torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k", [(1, 64), (5, 1000), (3, 8192)])
def test_quant_rows_matches_twin(dtype, t, k):
    x = torch.randn(t, k, generator=_gen(t + k)) * torch.logspace(-3, 2, t)[:, None]
    x[0, :7] = 0.0
    if t > 2:
        x[1] = 0.0  # an all-zero row: scale eps, values 0
    x = x.to(DEVICE, dtype)
    q, s = quant_rows(x)
    q_want, s_want = quant_rows_torch(x)
    assert q.dtype == FP8 and s.dtype == torch.float32
    assert torch.equal(s.cpu(), s_want.cpu())
    assert torch.equal(q.view(torch.uint8).cpu(), q_want.view(torch.uint8).cpu())


def test_quant_rows_error_is_e4m3_rounding():
    x = (
        torch.randn(6, 512, generator=_gen(3))
        * torch.tensor([1e-4, 1e-2, 1, 10, 300, 5e4])[:, None]
    )
    q, s = quant_rows_torch(x)
    back = q.float() * s[:, None]
    assert (q.float().abs().amax(dim=1) == FP8_MAX).all()  # each row's absmax maps to 448
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative) for normals; subnormal steps 2^-9 * s
    bound = torch.maximum(x.abs() * 2.0**-4, s[:, None] * 2.0**-10) * 1.0001
    assert ((back - x).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_dequant_cols_matches_twin(dtype, bias):
    g = _gen(7)
    t, n, e = 21, 300, 40
    acc = (torch.randn(t, n, generator=g) * 1e3).to(DEVICE)
    sx = (torch.rand(t, generator=g) * 1e-2).to(DEVICE)
    sw = (torch.rand(n, generator=g) * 1e-2).to(DEVICE)
    b = torch.randn(n + 5, generator=g).to(DEVICE, dtype) if bias else None
    wide = torch.full((t, n + e), 7.0, dtype=dtype, device=DEVICE)  # the tail stays untouched
    dequant_cols(acc, sx, sw, b, wide[:, :n])
    assert torch.equal(wide[:, :n].cpu(), dequant_cols_torch(acc, sx, sw, b, dtype).cpu())
    assert (wide[:, n:] == 7.0).all()


def _case(t: int, n: int, k: int, e: int, bias: bool, dtype: torch.dtype):
    g = _gen(t * 1000 + n + k + e)
    x = torch.randn(t, k, generator=g).to(DEVICE, dtype)
    q = (torch.randn(n, k, generator=g) * 3).to(FP8).to(DEVICE)
    scale = (torch.rand(n, 1, generator=g) * 0.05 + 0.01).to(DEVICE)
    a = (torch.randn(e, k, generator=g) * 0.1).to(DEVICE, dtype) if e else None
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, q, scale, a, b


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
if DEVICE == "cuda":
    # Hopper's fp8 MMA keeps ~14 bits of its running sum (cuBLASLt promotes to float32 between
    # K chunks, not after every product): the float32 result sits 2.0-2.2e-4 of the largest
    # output away from the exact float32 twin (H200, these cases). The rounding steps around
    # the GEMM stay bit-exact (the quant_rows / dequant_cols tests).
    TOL[torch.float32] = 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,k,e,bias", [(1, 96, 128, 0, False), (7, 64, 256, 24, True),
                                          (64, 160, 512, 48, False)])  # fmt: skip
def test_linear_matches_twin(dtype, t, n, k, e, bias):
    x, q, scale, a, b = _case(t, n, k, e, bias, dtype)
    got = fp8_w8a8_linear(x, q, scale, a, b)
    want = fp8_w8a8_linear_torch(x, q, scale, a, b)
    assert got.shape == (t, n + e) and got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(
        got.float().cpu(), want.float().cpu(), rtol=tol, atol=tol * want.abs().max().item()
    )


def test_linear_writes_into_out_and_keeps_the_weight_only_result_close():
    x, q, scale, a, b = _case(16, 128, 1024, 32, True, torch.float32)
    out = torch.empty(16, 160, device=DEVICE)
    assert fp8_w8a8_linear(x, q, scale, a, b, out=out) is out
    w8a16 = fp8_aug_linear_torch(x, q, scale, a, b)
    # per-token e4m3 activations: a few percent per element, far less over a K-long sum
    err = (out[:, :128] - w8a16[:, :128]).norm() / w8a16[:, :128].norm()
    assert err < 0.035, err  # 0.025 here: e4m3 keeps 3 mantissa bits of each activation
    torch.testing.assert_close(out[:, 128:], w8a16[:, 128:], rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_run():
    x, q, scale, _, _ = _case(4, 64, 128, 0, False, torch.float32)
    assert w8a8_supported(q, scale)
    groups = torch.ones(64, 2, device=DEVICE)
    assert not w8a8_supported(q, groups)
    with pytest.raises(ValueError, match="one scale per output channel"):
        fp8_w8a8_linear(x, q, groups)
    odd = q[:40]  # N not a multiple of 16
    assert not w8a8_supported(odd, scale[:40])
    with pytest.raises(ValueError, match="multiples of"):
        fp8_w8a8_linear(x, odd, scale[:40])
    with pytest.raises(ValueError, match="A rows"):
        fp8_w8a8_linear(x, q, scale, torch.ones(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        fp8_w8a8_linear(x, q, scale, out=torch.empty(4, 63, device=DEVICE))


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    x, q, scale, a, b = _case(32, 4096, 4096, 384, False, torch.bfloat16)
    eager = fp8_w8a8_linear(x, q, scale, a, b)
    out = torch.empty_like(eager)
    fp8_w8a8_linear(x, q, scale, a, b, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_w8a8_linear(x, q, scale, a, b, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
