"""Grouped LoRA ops: Triton vs torch reference vs a naive per-token loop.

Without CUDA the Triton kernels run through the interpreter (set before anything imports the
kernels); with CUDA the same cases run compiled on the GPU, plus bfloat16.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # Kernels decorated before the variable was set would be compiled ones: decorate again.
    for _name in ("triton_shrink", "triton_expand"):
        if f"loraplex.engine.model.lora.ops.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"loraplex.engine.model.lora.ops.{_name}"])

import pytest  # noqa: E402

from loraplex.engine.model.lora import ops  # noqa: E402
from loraplex.engine.model.lora.mapping import LoRAMapping  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's bfloat16 tl.dot is broken: bfloat16 only on a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _triton_kernels():
    pytest.importorskip("triton")
    from loraplex.engine.model.lora.ops.triton_expand import ExpandConfig
    from loraplex.engine.model.lora.ops.triton_shrink import ShrinkConfig

    return ShrinkConfig, ExpandConfig


# name: (token_slots, slot_ranks, R, slice widths, in_features)
CASES = {
    "mixed_ranks_unequal_slices": ([0, -1, 2, 2, 0, 3, -1, 1], [3, 16, 8, 1], 16, (32, 8, 8), 64),
    "rank1_buffer1": ([0, 0, -1, 0], [1], 1, (16,), 32),
    "rank64_and_3": ([1, 0, 1, -1, 0], [64, 3], 64, (16, 24), 32),
    "single_token": ([1], [5, 16], 16, (32, 8, 8), 64),
    "all_base": ([-1, -1, -1], [16, 16], 16, (32, 8, 8), 64),
    "unused_slots": ([4, -1, 1, 4, 4], [2, 7, 16, 16, 9, 16], 16, (24, 24), 48),
    "five_slices": ([0, 1, -1, 1, 0, 2], [16, 4, 12], 16, (16, 8, 8, 16, 5), 40),
    "long_segment": ([2] * 37 + [-1, 0, 0], [8, 16, 16], 16, (20,), 64),
}


def _data(case: str, dtype: torch.dtype, seed: int = 0):
    slots, ranks, r, widths, k = CASES[case]
    g = torch.Generator().manual_seed(seed)
    t, s, n, num_slots = len(slots), len(widths), sum(widths), len(ranks)
    offsets = tuple(sum(widths[:i]) for i in range(s + 1))

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)

    # x and y are column windows of wider tensors: non-contiguous rows.
    x = rnd(t, k + 7)[:, 3 : 3 + k]
    y_big = rnd(t, n + 9)
    a = rnd(s, num_slots, r, k, scale=k**-0.5)
    b = rnd(num_slots, n, r, scale=r**-0.5)
    mapping = LoRAMapping.build(slots, ranks, device=DEVICE)
    return slots, ranks, offsets, x, y_big, a, b, mapping


def _naive_shrink(x, a, slots, ranks):
    """Docstring loop, per token; returns (out, specified-mask)."""
    s_count, _, r, _ = a.shape
    out = torch.zeros(s_count, x.shape[0], r, dtype=torch.float32)
    known = torch.zeros_like(out, dtype=torch.bool)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        rank = ranks[slot]
        for s in range(s_count):
            out[s, t, :rank] = x[t].float().cpu() @ a[s, slot, :rank].float().cpu().T
            known[s, t, :rank] = True
    return out, known


def _naive_expand(y, shrunk, b, offsets, slots, ranks):
    y = y.float().cpu().clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        rank = ranks[slot]
        for s in range(len(offsets) - 1):
            lo, hi = offsets[s], offsets[s + 1]
            y[t, lo:hi] += shrunk[s, t, :rank].float().cpu() @ b[slot, lo:hi, :rank].float().cpu().T
    return y


def _base_rows(slots):
    return [t for t, slot in enumerate(slots) if slot < 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_naive_loop(case: str, dtype: torch.dtype) -> None:
    slots, ranks, offsets, x, y_big, a, b, mapping = _data(case, dtype)
    out = torch.full((a.shape[0], x.shape[0], a.shape[2]), float("nan"), device=DEVICE)
    ops.shrink_torch(x, a, mapping, out)
    want, known = _naive_shrink(x, a, slots, ranks)
    torch.testing.assert_close(out.cpu()[known], want[known], rtol=1e-5, atol=1e-5)

    y = y_big[:, 2 : 2 + offsets[-1]]
    y0 = y_big.clone()
    ops.expand_torch(y, out, b, offsets, mapping)
    want_y = _naive_expand(y0[:, 2 : 2 + offsets[-1]], out, b, offsets, slots, ranks)
    tol = TOL[dtype]
    torch.testing.assert_close(y.float().cpu(), want_y, rtol=tol, atol=tol)
    assert not torch.isnan(y).any()
    base = _base_rows(slots)
    assert torch.equal(y_big[base], y0[base])
    assert torch.equal(y_big[:, :2], y0[:, :2]) and torch.equal(
        y_big[:, 2 + offsets[-1] :], y0[:, 2 + offsets[-1] :]
    )


def _check_triton(case: str, dtype: torch.dtype, shrink_cfg=None, expand_cfg=None) -> None:
    slots, ranks, offsets, x, y_big, a, b, mapping = _data(case, dtype, seed=1)
    s, t, r = a.shape[0], x.shape[0], a.shape[2]
    out_tri = torch.full((s, t, r), float("nan"), device=DEVICE)
    out_ref = out_tri.clone()
    ops.shrink_triton(x, a, mapping, out_tri, config=shrink_cfg)
    ops.shrink_torch(x, a, mapping, out_ref)
    _, known = _naive_shrink(x, a, slots, ranks)
    known = known.to(DEVICE)
    tol = TOL[dtype]
    torch.testing.assert_close(out_tri[known], out_ref[known], rtol=tol, atol=tol)

    n = offsets[-1]
    y_ref_big = y_big.clone()
    ops.expand_triton(y_big[:, 2 : 2 + n], out_tri, b, offsets, mapping, config=expand_cfg)
    ops.expand_torch(y_ref_big[:, 2 : 2 + n], out_ref, b, offsets, mapping)
    y0 = _data(case, dtype, seed=1)[4]
    assert not torch.isnan(y_big).any()
    torch.testing.assert_close(y_big.float(), y_ref_big.float(), rtol=tol, atol=tol)
    base = _base_rows(slots)
    assert torch.equal(y_big[base], y0[base])  # base rows untouched
    assert torch.equal(y_big[:, :2], y0[:, :2]) and torch.equal(y_big[:, 2 + n :], y0[:, 2 + n :])
    if mapping.has_lora:
        assert not torch.equal(y_big, y0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case: str, dtype: torch.dtype) -> None:
    _triton_kernels()
    _check_triton(case, dtype)


@pytest.mark.parametrize("case", ["mixed_ranks_unequal_slices", "long_segment", "rank64_and_3"])
def test_triton_explicit_configs(case: str) -> None:
    shrink_cfg, expand_cfg = _triton_kernels()
    r = CASES[case][2]
    br = max(16, 1 << (r - 1).bit_length())
    # split-K with atomics, small tiles: several token tiles, N tiles and K steps per program
    _check_triton(
        case,
        torch.float32,
        shrink_cfg(block_m=16, block_r=br, block_k=16, split_k=2),
        expand_cfg(block_m=16, block_n=16, block_r=16),
    )
    _check_triton(
        case,
        torch.float16,
        shrink_cfg(block_m=32, block_r=br, block_k=32, split_k=1),
        expand_cfg(block_m=32, block_n=32, block_r=32, fast_h=True),
    )


def test_add_lora_dispatch_and_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mapping's ``triton`` flag picks the kernels; both give the docstring loop."""
    _triton_kernels()
    slots, ranks, offsets, x, y_big, a, b, mapping = _data(
        "mixed_ranks_unequal_slices", torch.float32
    )
    n = offsets[-1]
    calls = []
    real = ops.shrink_triton
    monkeypatch.setattr(ops, "shrink_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    results = []
    for triton in (False, True):
        m = LoRAMapping.build(slots, ranks, device=DEVICE, triton=triton)
        y = y_big[:, :n].clone()
        buf = torch.full((4, x.shape[0] + 3, a.shape[2] + 2), float("nan"), device=DEVICE)
        ops.add_lora(y, x, a, b, offsets, m, buffer=buf)
        results.append(y)
        assert len(calls) == int(triton)
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)
    want = _naive_expand(
        y_big[:, :n], _naive_shrink(x, a, slots, ranks)[0], b, offsets, slots, ranks
    )
    torch.testing.assert_close(results[0].cpu(), want, rtol=1e-4, atol=1e-4)

    y = y_big[:, :n].clone()
    ops.add_lora(y, x, a, b, offsets, mapping)  # the default (torch), allocated buffer
    torch.testing.assert_close(y, results[0], rtol=1e-4, atol=1e-4)


def test_no_lora_tokens_is_a_no_op() -> None:
    _, _, offsets, x, y_big, a, b, mapping = _data("all_base", torch.float32)
    assert not mapping.has_lora
    y = y_big[:, : offsets[-1]]
    y0 = y.clone()
    out = torch.full((a.shape[0], x.shape[0], a.shape[2]), float("nan"), device=DEVICE)
    ops.lora_shrink(x, a, mapping, out)
    ops.lora_expand(y, out, b, offsets, mapping)
    ops.add_lora(y, x, a, b, offsets, mapping)
    assert torch.equal(y, y0)


def test_shape_errors() -> None:
    _, _, offsets, x, y_big, a, b, mapping = _data("mixed_ranks_unequal_slices", torch.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        ops.lora_shrink(x, a, mapping, torch.empty(1, 1, 1, device=DEVICE))
    with pytest.raises(ValueError, match="float32"):
        ops.lora_shrink(x, a, mapping, torch.empty(3, x.shape[0], a.shape[2], device=DEVICE).half())
    out = torch.zeros(3, x.shape[0], a.shape[2], device=DEVICE)
    with pytest.raises(ValueError, match="slice_offsets"):
        ops.lora_expand(y_big[:, :48], out, b, (0, 32, 47), mapping)
    with pytest.raises(ValueError, match="smaller"):
        ops.add_lora(
            y_big[:, :48], x, a, b, offsets, mapping, buffer=torch.zeros(3, 1, 16, device=DEVICE)
        )
    with pytest.raises(ValueError, match="segments"):  # the fused path's mapping has none
        ops.add_lora(y_big[:, :48], x, a, b, offsets, LoRAMapping(mapping.token_slots))


# Llama-3-8B decode shapes: name -> (in_features, slice widths)
LLAMA3_8B = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layer", list(LLAMA3_8B))
@pytest.mark.parametrize("batch", [1, 64])
def test_triton_llama3_decode_shapes_gpu(layer: str, batch: int, dtype: torch.dtype) -> None:
    k, widths = LLAMA3_8B[layer]
    num_slots, r = 32, 16
    ranks = [(4, 8, 16, 16)[i % 4] for i in range(num_slots)]
    slots = [-1 if t % 9 == 5 else (t * 7) % 12 for t in range(batch)]
    offsets = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, k, device="cuda", generator=g).to(dtype)
    a = (torch.randn(len(widths), num_slots, r, k, device="cuda", generator=g) * k**-0.5).to(dtype)
    b = (torch.randn(num_slots, offsets[-1], r, device="cuda", generator=g) * r**-0.5).to(dtype)
    y0 = torch.randn(batch, offsets[-1], device="cuda", generator=g).to(dtype)
    mapping = LoRAMapping.build(slots, ranks, device="cuda")

    out_tri = torch.full((len(widths), batch, r), float("nan"), device="cuda")
    out_ref = out_tri.clone()
    ops.shrink_triton(x, a, mapping, out_tri)
    ops.shrink_torch(x, a, mapping, out_ref)
    y_tri, y_ref = y0.clone(), y0.clone()
    ops.expand_triton(y_tri, out_tri, b, offsets, mapping)
    ops.expand_torch(y_ref, out_ref, b, offsets, mapping)
    assert not torch.isnan(y_tri).any()
    base = _base_rows(slots)
    assert torch.equal(y_tri[base], y0[base])
    delta_ref = y_ref.float() - y0.float()
    err = (y_tri.float() - y_ref.float()).norm() / delta_ref.norm().clamp_min(1e-6)
    assert err < 1e-2, f"relative error {err:.3e}"
