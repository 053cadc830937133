"""Fused decode kernels at Llama-3-8B decode sizes in bfloat16 on the GPU: Triton against the
torch twins (add_rmsnorm, silu_mul, qkv_rope), and one CUDA graph replayed with new slots,
positions and cache slots. The small-shape Triton-vs-twin tests: test_fused_kernels.py."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model import kernels as K
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.rope import RotaryEmbedding

EPS = 1e-5
L8 = 32  # slots


def _mapping(token_slots: torch.Tensor, triton: bool = False) -> LoRAMapping:
    return LoRAMapping(token_slots, triton=triton)


H8, I8, HQ8, HKV8, D8, R8 = 4096, 14336, 32, 8, 128, 16


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _llama8b_inputs(t: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    slots = torch.randint(-1, L8, (t,), generator=g, device="cuda", dtype=torch.int32)
    slots = _mapping(slots)
    smap = torch.randperm(4096, generator=g, device="cuda")[:t]
    smap[torch.rand(t, generator=g, device="cuda") < 0.1] = -1
    pos = torch.randint(0, 8192, (t,), generator=g, device="cuda")

    def ya(n: int, s: int) -> torch.Tensor:
        return torch.randn(t, n + s * L8 * R8, generator=g, **bf)

    def lb(n: int) -> torch.Tensor:
        return torch.randn(L8, n, R8, generator=g, **bf) * 0.05

    return slots, smap, pos, ya, lb


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 37, 512])
def test_llama3_8b_decode_sizes_gpu(t: int) -> None:
    from loraplex.engine.model.kernels.add_rmsnorm import lora_add_rmsnorm_triton
    from loraplex.engine.model.kernels.qkv_rope import lora_qkv_rope_triton
    from loraplex.engine.model.kernels.silu_mul import lora_silu_mul_triton

    slots, smap, pos, ya, lb = _llama8b_inputs(t, seed=t)
    res = torch.randn(t, H8, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H8, device="cuda", dtype=torch.bfloat16)
    y, b = ya(H8, 1), lb(H8)
    outs = []
    for fn in (K.lora_add_rmsnorm_torch, lora_add_rmsnorm_triton):
        r, o = res.clone(), torch.full_like(res, float("nan"))
        fn(y, r, b, slots, w, EPS, o)
        outs.append((r, o))
    assert _rel(outs[1][0], outs[0][0]) < 1e-2 and _rel(outs[1][1], outs[0][1]) < 1e-2

    y, b = ya(2 * I8, 2), lb(2 * I8)
    o_ref = torch.full((t, I8), float("nan"), device="cuda", dtype=torch.bfloat16)
    o = o_ref.clone()
    K.lora_silu_mul_torch(y, b, slots, o_ref)
    lora_silu_mul_triton(y, b, slots, o)
    assert _rel(o, o_ref) < 1e-2

    qs, ks = HQ8 * D8, HKV8 * D8
    y, b = ya(qs + 2 * ks, 3), lb(qs + 2 * ks)
    rope = RotaryEmbedding(D8, 8192, 500000.0, None, "cuda")
    res_qkv = []
    for fn in (K.lora_qkv_rope_torch, lora_qkv_rope_triton):
        kc = torch.zeros(256, 16, HKV8, D8, device="cuda", dtype=torch.bfloat16)
        vc, q = kc.clone(), torch.full((t, HQ8, D8), float("nan"), device="cuda", dtype=kc.dtype)
        fn(y, b, slots, pos, rope.cos, rope.sin, kc, vc, smap, q)
        res_qkv.append((q, kc, vc))
    for got, want in zip(res_qkv[1], res_qkv[0], strict=True):
        assert _rel(got, want) < 1e-2


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_slots_gpu() -> None:
    """Captured once; new slots / positions / slot_mapping contents on replay are honoured."""
    t, h, inter, qs, ks = 64, 512, 1024, 4 * D8, 2 * D8
    slots, smap, pos, ya, lb = _llama8b_inputs(t, seed=7)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    y_o, b_o, y_gu, b_gu = ya(h, 1), lb(h), ya(2 * inter, 2), lb(2 * inter)
    y_qkv, b_qkv = ya(qs + 2 * ks, 3), lb(qs + 2 * ks)
    res, w, normed = torch.randn(t, h, **bf), torch.randn(h, **bf), torch.empty(t, h, **bf)
    act, q = torch.empty(t, inter, **bf), torch.empty(t, 4, D8, **bf)
    kc, vc = torch.zeros(256, 16, 2, D8, **bf), torch.zeros(256, 16, 2, D8, **bf)
    rope = RotaryEmbedding(D8, 8192, 500000.0, None, "cuda")

    def step(fns, mapping) -> None:
        fns[0](y_o, res, b_o, mapping, w, EPS, normed)
        fns[1](y_gu, b_gu, mapping, act)
        fns[2](y_qkv, b_qkv, mapping, pos, rope.cos, rope.sin, kc, vc, smap, q)

    fused = (K.lora_add_rmsnorm, K.lora_silu_mul, K.lora_qkv_rope)
    twins = (K.lora_add_rmsnorm_torch, K.lora_silu_mul_torch, K.lora_qkv_rope_torch)
    on_triton = _mapping(slots.token_slots, triton=True)
    step(fused, on_triton)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(fused, on_triton)
    for seed in (8, 9):
        new_slots, new_smap, new_pos, *_ = _llama8b_inputs(t, seed=seed)
        pairs = ((slots.token_slots, new_slots.token_slots), (smap, new_smap), (pos, new_pos))
        for dst, src in pairs:
            dst.copy_(src)
        for y in (y_o, y_gu, y_qkv):
            y.normal_()
        kc.zero_(), vc.zero_()
        res0 = res.clone()
        graph.replay()
        got = [x.clone() for x in (res, normed, act, q, kc, vc)]
        res.copy_(res0), kc.zero_(), vc.zero_()
        step(twins, slots)
        for g_, w_ in zip(got, (res, normed, act, q, kc, vc), strict=True):
            assert _rel(g_, w_) < 1e-2
