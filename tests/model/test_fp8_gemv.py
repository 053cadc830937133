"""The CUDA-core fp8 GEMV of 1-4 tokens (kernels/fp8_gemv.py, ``_fp8_gemv_kernel``) against
the torch twin ``fp8_aug_linear_torch``: A rows, bias, group scales, split-K, ragged shapes,
and the dispatch of ``fp8_aug_linear`` to it. On CPU the kernel runs in the Triton interpreter
(float32 / float16, small shapes); bfloat16, the Llama-3-8B projections and CUDA graphs run
on the GPU (``-m gpu``).

Tolerance: the GEMV and the twin both accumulate in float32 and round once to the output
dtype; they differ only in the order of the float32 sums (K <= 14336 terms, relative error
~K x 2^-24 of the sum of |terms| at worst), so in float32 the outputs agree to ~1e-5 of the
largest output, and in float16 / bfloat16 an element may round to the neighbouring value
(one ulp: 2^-11 / 2^-8 relative)."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.kernels import fp8_linear
from loraplex.engine.model.kernels.fp8_linear import (
    GEMV_CONFIGS,
    GEMV_MAX_TOKENS,
    GEMV_TOKENS,
    Fp8GemvConfig,
    fp8_aug_linear,
    fp8_aug_linear_torch,
    fp8_gemv_config,
    prepare_fp8_linear,
)
from tests.helpers.fp8 import assert_graph_matches_eager

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + (
    [pytest.param(torch.bfloat16, marks=pytest.mark.gpu)] if DEVICE == "cuda" else []
)
# rtol: float32 sum order (see the module docstring); 16-bit: one ulp of the output
RTOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _case(t: int, n: int, k: int, groups: int, e: int, bias: bool, dtype: torch.dtype, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + t * 1000 + n + k + groups + e)
    x = torch.randn(t, k, generator=g).to(DEVICE, dtype)
    q = (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn).to(DEVICE)
    scale = (torch.rand(n, groups, generator=g) * 0.05 + 0.01).to(DEVICE)
    a = torch.randn(e, k, generator=g).to(DEVICE, dtype) if e else None
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, q, scale, a, b


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    got, want = got.float(), want.float()
    tol = RTOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def _run(x, q, scale, a, b, cfg) -> torch.Tensor:
    """The GEMV into a NaN-poisoned output: every element must be written."""
    out = torch.full((x.shape[0], q.shape[0] + (a.shape[0] if a is not None else 0)),
                     float("nan"), dtype=x.dtype, device=x.device)  # fmt: skip
    assert fp8_aug_linear(x, q, scale, a, b, config=cfg, out=out) is out
    assert not out.isnan().any(), "elements left unwritten"
    return out


# (t, n, k, groups, e, bias, config): small shapes for the interpreter
CASES = [
    (1, 96, 256, 1, 16, True, Fp8GemvConfig(16, 64)),  # one token, bias, A rows
    (2, 96, 256, 1, 16, False, Fp8GemvConfig(16, 64, split_k=2)),  # split-K
    (2, 96, 256, 1, 16, True, Fp8GemvConfig(32, 64, split_k=4, early_sum=False)),
    (1, 70, 192, 1, 20, True, Fp8GemvConfig(16, 128)),  # ragged N, E and K (masked K step)
    (3, 70, 192, 1, 20, False, Fp8GemvConfig(32, 64, early_sum=False)),  # 3 tokens
    (4, 48, 256, 2, 8, True, Fp8GemvConfig(16, 64, split_k=2)),  # group scales, 4 tokens
    (2, 40, 128, 1, 0, True, Fp8GemvConfig(8, 32, split_k=4, num_stages=2)),  # no A rows
    (1, 64, 256, 4, 24, False, Fp8GemvConfig(16, 64, unroll=2, early_sum=False)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,k,groups,e,bias,cfg", CASES)
def test_gemv_matches_twin(dtype, t, n, k, groups, e, bias, cfg) -> None:
    for seed in range(2):  # fresh inputs, same compiled kernel
        x, q, scale, a, b = _case(t, n, k, groups, e, bias, dtype, seed)
        got = _run(x, q, scale, a, b, cfg)
        _close(got, fp8_aug_linear_torch(x, q, scale, a, b), dtype)
    if cfg.split_k > 1:  # the counters were reset: a second launch reduces again, same bits
        assert int(prepare_fp8_linear(DEVICE).abs().sum()) == 0
        assert torch.equal(fp8_aug_linear(x, q, scale, a, b, config=cfg), got)


def test_x_row_stride() -> None:
    """Tokens are rows of a wider buffer (x.stride(0) > K), as the engine may pass them."""
    x, q, scale, a, b = _case(2, 48, 128, 1, 8, True, torch.float32)
    wide = torch.randn(2, 192, device=DEVICE)
    wide[:, :128] = x
    got = _run(wide[:, :128], q, scale, a, b, Fp8GemvConfig(16, 64, split_k=2))
    _close(got, fp8_aug_linear_torch(x, q, scale, a, b), torch.float32)


def test_dispatch_takes_the_gemv_up_to_the_threshold(monkeypatch) -> None:
    calls = []
    launch = fp8_linear._launch_gemv
    monkeypatch.setattr(
        fp8_linear, "_launch_gemv", lambda *args: calls.append(args[-1]) or launch(*args)
    )
    for t in range(1, GEMV_MAX_TOKENS + 2):
        x, q, scale, a, b = _case(t, 48, 256, 1, 8, True, torch.float32)
        got = fp8_aug_linear(x, q, scale, a, b)  # no config: the engine's path
        _close(got, fp8_aug_linear_torch(x, q, scale, a, b), torch.float32)
        assert len(calls) == min(t, GEMV_MAX_TOKENS), t
    assert calls[0] == fp8_gemv_config(1, 48, 256, 256, 8)


def test_gemv_config_fits_shapes() -> None:
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (576, 576), (1536, 576)]
    for t in range(1, GEMV_TOKENS + 1):
        for n, k in shapes:
            for group in (32, 128, k):
                cfg = fp8_gemv_config(t, n, k, group, 128)
                assert group == k or group % cfg.block_k == 0, (t, n, k, group, cfg)
                assert cfg.split_k == 1 or k % (cfg.split_k * cfg.block_k) == 0, cfg
    for (n, k, t), cfg in GEMV_CONFIGS.items():  # the measured table is consistent
        assert 1 <= t <= GEMV_TOKENS and k % (cfg.split_k * cfg.block_k) == 0, (n, k, cfg)


def test_gemv_refuses_bad_launches() -> None:
    x, q, scale, a, _ = _case(GEMV_TOKENS + 1, 32, 128, 1, 8, False, torch.float32)
    with pytest.raises(ValueError, match="at most"):
        fp8_aug_linear(x, q, scale, a, config=Fp8GemvConfig(16, 64))
    with pytest.raises(ValueError, match="SPLIT_K"):
        fp8_aug_linear(x[:1], q, scale, a, config=Fp8GemvConfig(16, 64, split_k=4))
    with pytest.raises(ValueError, match="BLOCK_K"):
        group_scales = torch.ones(32, 4, device=DEVICE)  # groups of 32 columns
        fp8_aug_linear(x[:1], q, group_scales, a, config=Fp8GemvConfig(16, 64))


# --- GPU: bfloat16 at the Llama-3-8B projections (8 slots of rank 16), CUDA graphs

LLAMA = [(6144, 4096, 384), (4096, 4096, 128), (28672, 4096, 256), (4096, 14336, 128)]


def _llama(n: int, k: int, e: int, t: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(n + k + t + seed)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    a = torch.randn(e, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    return x, q, scale, a


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,e", LLAMA)
@pytest.mark.parametrize("t", [1, 2])
def test_llama_shapes_engine_gemv(n, k, e, t) -> None:
    """``fp8_aug_linear`` as the engine calls it (no config: the GEMV with its own config) at
    the Llama-3-8B projections, fresh random data, against the twin element by element;
    repeated launches give the same bits (no race in the split-K reduction)."""
    assert t <= GEMV_MAX_TOKENS
    for seed in range(2):
        x, q, scale, a = _llama(n, k, e, t, seed)
        got = fp8_aug_linear(x, q, scale, a)
        _close(got, fp8_aug_linear_torch(x, q, scale, a), torch.bfloat16)
    for _ in range(20):
        assert torch.equal(fp8_aug_linear(x, q, scale, a), got)


GPU_CONFIGS = [
    Fp8GemvConfig(16, 256, split_k=4),
    Fp8GemvConfig(16, 256, early_sum=False),
    Fp8GemvConfig(32, 128, split_k=2, num_warps=8),
    Fp8GemvConfig(16, 256, split_k=2, num_stages=3),
    Fp8GemvConfig(8, 512, split_k=2, unroll=2, early_sum=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,e", LLAMA)
@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=str)
def test_llama_shapes_gemv_configs(n, k, e, t, cfg) -> None:
    """The configs the benchmark sweeps over (accumulator kinds, split-K, pipelining,
    unrolling, up to GEMV_TOKENS tokens) compile and match the twin at the Llama shapes."""
    x, q, scale, a = _llama(n, k, e, t)
    got = _run(x, q, scale, a, None, cfg)
    _close(got, fp8_aug_linear_torch(x, q, scale, a), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,k,e,t", [(4096, 14336, 128, 1), (4096, 4096, 128, 1), (28672, 4096, 256, 2)]
)
def test_cuda_graph_gemv_matches_eager(n, k, e, t) -> None:
    x, q, scale, a = _llama(n, k, e, t)
    cfg = fp8_gemv_config(t, n, k, k, e)
    if k == 14336:  # down at one token (the engine's config): the graph holds a split-K sum
        assert cfg.split_k > 1
    assert_graph_matches_eager(x, lambda: fp8_aug_linear(x, q, scale, a))
