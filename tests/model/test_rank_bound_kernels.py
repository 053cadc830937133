"""The fused epilogues at a rank bound (model/lora/ranks.py): a step reading only the rank-major A
rows of ranks < r_b gives what the full-rank step gives when every row's adapter has rank
<= r_b; Triton (interpreted on CPU) against the twins, in a rank-64 slot layout."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model import kernels as K
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L, R, EPS = 3, 64, 1e-5
SLOT_RANKS = (8, 5, 16)  # slot 1 holds rank 5, slot 2 rank 16
SLOTS = [0, -1, 2, 1, 1, -1, 0, 2]
HQ, HKV, D = 4, 2, 16


def _inputs(n_base: int, num_slices: int, bound: int, dtype=torch.float32, seed=0):
    """x, y_aug at full rank and at ``bound`` (a column prefix of a real augmented GEMM with
    rank-major A rows), lora_b (L, N, R) zero past each slot's rank."""
    g = torch.Generator().manual_seed(seed)
    t, k = len(SLOTS), 32
    x = torch.randn(t, k, generator=g)
    w = torch.randn(n_base, k, generator=g) / k**0.5
    a = torch.randn(num_slices, L, R, k, generator=g) / k**0.5
    b = torch.randn(L, n_base, R, generator=g) / 4
    for slot, r in enumerate(SLOT_RANKS):
        a[:, slot, min(r, bound) :] = 0
        b[slot, :, min(r, bound) :] = 0
    rows = torch.cat([w, a.permute(2, 0, 1, 3).reshape(-1, k)])  # rank-major (layers.py)
    y_full = (x @ rows.T).to(DEVICE, dtype)
    y_bound = y_full[:, : n_base + bound * num_slices * L]
    return y_full, y_bound, b.to(DEVICE, dtype)


def _maps(bound: int, triton: bool) -> tuple[LoRAMapping, LoRAMapping]:
    ts = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    return LoRAMapping(ts, triton=False), LoRAMapping(ts, triton=triton, rank_bound=bound)


def _close(got, want, tol=1e-5):
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("bound", [16, 32])
def test_add_rmsnorm_at_a_rank_bound(bound: int, triton: bool) -> None:
    h = 64
    y_full, y_bound, b = _inputs(h, 1, bound)
    full, bounded = _maps(bound, triton)
    res0 = torch.randn(len(SLOTS), h, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    w = torch.randn(h, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want_res, want = res0.clone(), torch.empty_like(res0)
    K.lora_add_rmsnorm(y_full, want_res, b, full, w, EPS, want)
    configs = [None]
    if triton:  # the split rows of steps above rank 16, and the one-row kernel
        from loraplex.engine.model.kernels.add_rmsnorm import NormConfig, lora_add_rmsnorm_triton

        configs += [
            NormConfig(1, 16, 2, True),
            NormConfig(4, 16, 2, True),
            NormConfig(16, 32, 4, True),
        ]
        configs += [NormConfig(1, 64, 4)]
    for cfg in configs:
        res, out = res0.clone(), torch.full_like(res0, float("nan"))
        if cfg is None:
            K.lora_add_rmsnorm(y_bound, res, b, bounded, w, EPS, out)
        else:
            lora_add_rmsnorm_triton(y_bound, res, b, bounded, w, EPS, out, config=cfg)
        _close(res, want_res)
        _close(out, want)


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("bound", [16, 32])
def test_silu_mul_at_a_rank_bound(bound: int, triton: bool) -> None:
    inter = 48
    y_full, y_bound, b = _inputs(2 * inter, 2, bound, seed=1)
    full, bounded = _maps(bound, triton)
    want = torch.empty(len(SLOTS), inter, device=DEVICE)
    K.lora_silu_mul(y_full, b, full, want)
    configs = [None]
    if triton:
        from loraplex.engine.model.kernels.silu_mul import SiluMulConfig, lora_silu_mul_triton

        configs += [SiluMulConfig(16, 32, 4, 16), SiluMulConfig(1, 64, 4)]
        configs += [SiluMulConfig(16, 32, 4)]  # the per-slot loop with tensor-core dots
    for cfg in configs:
        out = torch.full_like(want, float("nan"))
        if cfg is None:
            K.lora_silu_mul(y_bound, b, bounded, out)
        else:
            lora_silu_mul_triton(y_bound, b, bounded, out, config=cfg)
        _close(out, want)


@pytest.mark.parametrize("triton", [False, True])
def test_qkv_rope_at_a_rank_bound(triton: bool) -> None:
    bound, t = 16, len(SLOTS)
    n = (HQ + 2 * HKV) * D
    y_full, y_bound, b = _inputs(n, 3, bound, seed=2)
    full, bounded = _maps(bound, triton)
    rope = RotaryEmbedding(D, 64, 10000.0, None, DEVICE)
    pos = torch.arange(3, 3 + t, device=DEVICE)
    smap = torch.tensor([5, 9, -1, 0, 14, 3, 7, 11], device=DEVICE)
    outs = []
    for y, m in ((y_full, full), (y_bound, bounded)):
        kc = torch.zeros(4, 4, HKV, D, device=DEVICE)
        vc, q = kc.clone(), torch.full((t, HQ, D), float("nan"), device=DEVICE)
        K.lora_qkv_rope(y, b, m, pos, rope.cos, rope.sin, kc, vc, smap, q)
        outs.append((q, kc, vc))
    for got, want in zip(outs[1], outs[0], strict=True):
        _close(got, want)


def test_rank_bound_checks_the_columns() -> None:
    """y_aug must hold the bound's shrink columns: N + S * L * r_b."""
    _, y_bound, b = _inputs(64, 1, 16)
    full, bounded = _maps(32, False)
    res, out = (
        torch.zeros(len(SLOTS), 64, device=DEVICE),
        torch.empty(len(SLOTS), 64, device=DEVICE),
    )
    with pytest.raises(ValueError, match="N \\+ S\\*L\\*Rb"):
        K.lora_add_rmsnorm(y_bound, res, b, bounded, torch.ones(64, device=DEVICE), EPS, out)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 64, 256])
@pytest.mark.parametrize("bound", [8, 32, 64])
def test_add_rmsnorm_llama8b_rank_buckets_gpu(t: int, bound: int) -> None:
    """bf16, hidden 4096, 8 slots of rank 64 read at each bucket: Triton (the split rows above
    rank 16) against the twin, graph-captured and replayed."""
    from loraplex.engine.model.kernels.add_rmsnorm import norm_config

    g = torch.Generator(device="cuda").manual_seed(t + bound)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    h, slots_n = 4096, 8
    assert norm_config(t, h, bound).split == (bound > 16)
    ts = torch.randint(-1, slots_n, (t,), generator=g, device="cuda", dtype=torch.int32)
    y = torch.randn(t, h + bound * slots_n, generator=g, **bf)
    b = torch.randn(slots_n, h, 64, generator=g, **bf) * 0.05
    res0 = torch.randn(t, h, generator=g, **bf)
    w = torch.randn(h, generator=g, **bf)
    want_res, want = res0.clone(), torch.empty_like(res0)
    K.lora_add_rmsnorm_torch(y, want_res, b, LoRAMapping(ts, rank_bound=bound), w, EPS, want)
    mapping = LoRAMapping(ts, triton=True, rank_bound=bound)
    res, out = res0.clone(), torch.empty_like(res0)
    K.lora_add_rmsnorm(y, res, b, mapping, w, EPS, out)  # compiles, allocates the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.lora_add_rmsnorm(y, res, b, mapping, w, EPS, out)
    for _ in range(3):  # the row counters are back at 0 after every launch
        res.copy_(res0)
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in ((res, want_res), (out, want)):
            assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
