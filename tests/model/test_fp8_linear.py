"""The fp8 augmented GEMM (kernels/fp8_linear.py): Triton kernel vs its torch twin, the twin vs
de-quantize-then-GEMM, split-K reduction. On CPU the kernel runs in the Triton interpreter
(float32 / float16); bfloat16, Llama shapes and CUDA graphs run on the GPU."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.kernels.fp8_linear import (
    CONFIGS,
    Fp8LinearConfig,
    fp8_aug_linear,
    fp8_aug_linear_torch,
    fp8_linear_config,
    prepare_fp8_linear,
)
from loraplex.engine.model.quant import dequantize_fp8
from tests.helpers.fp8 import assert_graph_matches_eager

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + (
    [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if DEVICE == "cuda" else []
)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _case(t: int, n: int, k: int, groups: int, e: int, bias: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(t * 1000 + n + k + groups + e)
    x = torch.randn(t, k, generator=g).to(DEVICE, dtype)
    q = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn).to(DEVICE)
    scale = (torch.rand(n, groups, generator=g) * 0.05 + 0.01).to(DEVICE)
    a = torch.randn(e, k, generator=g).to(DEVICE, dtype) if e else None
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, q, scale, a, b


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.float(), want.float()
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * want.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,n,k,groups,e,bias,split",
    [
        (1, 70, 128, 1, 16, True, 1),  # one row, N not a tile multiple, bias, A rows
        (5, 64, 256, 2, 0, False, 1),  # group scales (128 columns each), no A rows
        (19, 40, 64, 1, 24, False, 1),  # rows over one M tile, K one tile
        (3, 70, 256, 1, 20, True, 4),  # split-K: 4 programs per tile, bias after the sum
        (17, 48, 256, 2, 8, False, 2),  # split-K with group scales, two M tiles
    ],
)
def test_kernel_matches_twin(dtype, t, n, k, groups, e, bias, split) -> None:
    x, q, scale, a, b = _case(t, n, k, groups, e, bias, dtype)
    cfg = Fp8LinearConfig(block_m=16, block_n=32, block_k=64, split_k=split, num_stages=2)
    got = fp8_aug_linear(x, q, scale, a, b, config=cfg)
    assert got.shape == (t, n + e)
    _close(got, fp8_aug_linear_torch(x, q, scale, a, b), dtype)
    if split > 1:  # the counters were reset: a second launch reduces again, to the same bits
        assert int(prepare_fp8_linear(DEVICE).abs().sum()) == 0
        assert torch.equal(fp8_aug_linear(x, q, scale, a, b, config=cfg), got)


def test_out_buffer_is_written_in_place() -> None:
    x, q, scale, a, b = _case(2, 32, 128, 1, 16, True, torch.float32)
    out = torch.full((2, 48), float("nan"), device=DEVICE)
    cfg = Fp8LinearConfig(block_m=16, block_n=32, block_k=64, split_k=2, num_stages=2)
    assert fp8_aug_linear(x, q, scale, a, b, config=cfg, out=out) is out
    _close(out, fp8_aug_linear_torch(x, q, scale, a, b), torch.float32)


def test_twin_is_dequantized_gemm() -> None:
    x, q, scale, a, b = _case(3, 48, 256, 2, 8, True, torch.float32)
    w = torch.cat([dequantize_fp8(q, scale, torch.float32), a])
    want = x @ w.t()
    want[:, :48] += b
    torch.testing.assert_close(fp8_aug_linear_torch(x, q, scale, a, b), want)


def test_engine_config_fits_shapes() -> None:
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (576, 576), (1536, 576)]
    for t in (1, 16, 33, 64, 256):
        for n, k in shapes:
            for group in (128, k):
                cfg = fp8_linear_config(t, n, k, group)
                assert group == k or group % cfg.block_k == 0
                assert cfg.split_k == 1 or k % (cfg.split_k * cfg.block_k) == 0
                assert cfg.block_m >= min(t, 16) and (t > 64 or cfg.block_m >= t)
    for (n, k, bm), cfg in CONFIGS.items():  # the measured table is consistent
        assert cfg.block_m == bm and k % (cfg.split_k * cfg.block_k) == 0, (n, k, cfg)


def test_bad_shapes_are_refused() -> None:
    x, q, scale, a, _ = _case(2, 32, 64, 1, 8, False, torch.float32)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_aug_linear(x, q, scale[:16], a)
    with pytest.raises(ValueError, match="A rows"):
        fp8_aug_linear(x, q, scale, a[:, :32])
    with pytest.raises(ValueError, match="BLOCK_K"):
        cfg = Fp8LinearConfig(block_k=64)
        fp8_aug_linear(x, q, torch.ones(32, 2, device=DEVICE), a, config=cfg)
    with pytest.raises(ValueError, match="SPLIT_K"):
        fp8_aug_linear(x, q, scale, a, config=Fp8LinearConfig(block_k=64, split_k=2))


LLAMA = [(6144, 4096, 384), (4096, 4096, 128), (28672, 4096, 256), (4096, 14336, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,e", LLAMA)
@pytest.mark.parametrize("t", [1, 13, 64, 200])
def test_llama_shapes_engine_config(n, k, e, t) -> None:
    """The engine's own configs (split-K included) on the Llama-3-8B projections, fresh
    random data, against the twin; repeated launches give the same bits (no race in the
    split-K reduction)."""
    g = torch.Generator(device="cuda").manual_seed(n + k + t)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    a = torch.randn(e, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    want = fp8_aug_linear_torch(x, q, scale, a)
    got = fp8_aug_linear(x, q, scale, a)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, err
    for _ in range(20):
        assert torch.equal(fp8_aug_linear(x, q, scale, a), got)


@pytest.mark.gpu
def test_cuda_graph_matches_eager() -> None:
    n, k, e, t = 4096, 4096, 128, 8
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda") * 0.02
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    a = torch.randn(e, k, device="cuda", dtype=torch.bfloat16) * 0.02
    assert fp8_linear_config(t, n, k, k, x.device).split_k > 1  # the graph holds the split-K sums
    assert_graph_matches_eager(x, lambda: fp8_aug_linear(x, q, scale, a))
