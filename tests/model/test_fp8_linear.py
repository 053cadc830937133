"""The fp8 augmented GEMM (kernels/fp8_linear.py): Triton kernel vs its torch twin, the twin vs
de-quantize-then-GEMM. On CPU the kernel runs in the Triton interpreter (float32 / float16);
bfloat16 runs on the GPU."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.kernels.fp8_linear import (
    Fp8LinearConfig,
    fp8_aug_linear,
    fp8_aug_linear_torch,
    fp8_linear_config,
)
from loraplex.engine.model.quant import dequantize_fp8

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,n,k,groups,e,bias",
    [
        (1, 70, 128, 1, 16, True),  # one row, N not a tile multiple, bias, A rows
        (5, 64, 256, 2, 0, False),  # group scales (128 columns each), no A rows
        (19, 40, 64, 1, 24, False),  # rows over one M tile, K one tile
    ],
)
def test_kernel_matches_twin(dtype, t, n, k, groups, e, bias) -> None:
    x, q, scale, a, b = _case(t, n, k, groups, e, bias, dtype)
    cfg = Fp8LinearConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    got = fp8_aug_linear(x, q, scale, a, b, config=cfg).float()
    want = fp8_aug_linear_torch(x, q, scale, a, b).float()
    assert got.shape == (t, n + e)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype] * want.abs().max())


def test_twin_is_dequantized_gemm() -> None:
    x, q, scale, a, b = _case(3, 48, 256, 2, 8, True, torch.float32)
    w = torch.cat([dequantize_fp8(q, scale, torch.float32), a])
    want = x @ w.t()
    want[:, :48] += b
    torch.testing.assert_close(fp8_aug_linear_torch(x, q, scale, a, b), want)


def test_engine_config_divides_scale_groups() -> None:
    for t in (1, 16, 33, 64, 256):
        for group in (128, 256, 4096):
            cfg = fp8_linear_config(t, 4096, 4096, group)
            assert group % cfg.block_k == 0 and cfg.block_m >= min(t, 16)


def test_bad_shapes_are_refused() -> None:
    x, q, scale, a, _ = _case(2, 32, 64, 1, 8, False, torch.float32)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_aug_linear(x, q, scale[:16], a)
    with pytest.raises(ValueError, match="A rows"):
        fp8_aug_linear(x, q, scale, a[:, :32])
    with pytest.raises(ValueError, match="BLOCK_K"):
        cfg = Fp8LinearConfig(block_k=64)
        fp8_aug_linear(x, q, torch.ones(32, 2, device=DEVICE), a, config=cfg)
