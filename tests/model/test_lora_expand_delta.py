"""``lora_expand_delta``: every row's LoRA delta of a projection into an fp32 buffer (the form a
side stream computes beside the base GEMM). Triton (interpreted on CPU) and the twin against a
per-row loop over the rank-major shrink layout, at slices that split a column block, a rank
bound, rows of no adapter, and the shrink as the right-hand columns of an augmented GEMM."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.lora.ops.expand_delta import ExpandDeltaConfig, lora_expand_delta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L, R = 3, 32
SLOTS = [0, -1, 2, 1, 1, -1, 0, 2, 2, 0, -1, 1, 0, 0, 2, 1, 1, -1]


def _want(shrink, b, slots, offsets, rows):
    """delta[t, n] = sum_r shrink[t, (r * S + s) * L + slot] * B[slot, n, r], row by row."""
    s_count = len(offsets) - 1
    t, n = shrink.shape[0], b.shape[1]
    out = torch.zeros(t, n, dtype=torch.float64)
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        for s in range(s_count):
            lo, hi = offsets[s], offsets[s + 1]
            cols = [(r * s_count + s) * L + slot for r in range(rows)]
            h = shrink[i, cols].double()
            out[i, lo:hi] = b[slot, lo:hi, :rows].double() @ h
    return out


def _case(widths, bound=None, dtype=torch.float32, seed=0, n_base=0):
    g = torch.Generator().manual_seed(seed)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    rows = R if bound is None else bound
    t, s_count = len(SLOTS), len(widths)
    y_aug = torch.randn(t, n_base + rows * s_count * L, generator=g).to(DEVICE, dtype)
    shrink = y_aug[:, n_base:]
    b = (torch.randn(L, R, offsets[-1], generator=g) / 4).permute(0, 2, 1).to(DEVICE, dtype)
    ts = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    return shrink, b, ts, offsets, rows


CONFIGS = [
    ExpandDeltaConfig(),
    ExpandDeltaConfig(stages=0),
    ExpandDeltaConfig(block_t=16, block_n=32, stages=3),
    ExpandDeltaConfig(block_t=4, block_n=16, stages=0),  # no tensor-core dot
    ExpandDeltaConfig(block_t=4, block_n=64, stages=2),
]


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize(
    "widths", [(64, 32, 32), (40, 24, 24), (48, 48), (72,)], ids=["qkv", "odd", "gate_up", "one"]
)
def test_delta_against_the_row_loop(widths, triton: bool) -> None:
    shrink, b, ts, offsets, rows = _case(widths)
    want = _want(shrink.cpu(), b.cpu(), SLOTS, offsets, rows)
    mapping = LoRAMapping(ts, triton=triton)
    for cfg in CONFIGS if triton else [None]:
        out = torch.full((len(SLOTS), offsets[-1]), float("nan"), device=DEVICE)
        lora_expand_delta(shrink, b, mapping, offsets, out, config=cfg)
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5, msg=str(cfg))


@pytest.mark.parametrize("triton", [False, True])
def test_delta_at_a_rank_bound_from_augmented_columns(triton: bool) -> None:
    """The shrink as a GEMM's columns right of 24 base columns, 16 of 32 rank rows read."""
    shrink, b, ts, offsets, rows = _case((64, 32, 32), bound=16, n_base=24, seed=1)
    assert shrink.stride(0) == 24 + shrink.shape[1]
    want = _want(shrink.cpu(), b.cpu(), SLOTS, offsets, rows)
    out = torch.empty(len(SLOTS), offsets[-1], device=DEVICE)
    lora_expand_delta(shrink, b, LoRAMapping(ts, triton=triton, rank_bound=16), offsets, out)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("triton", [False, True])
def test_delta_in_float16(triton: bool) -> None:
    shrink, b, ts, offsets, rows = _case((48, 48), dtype=torch.float16, seed=2)
    want = _want(shrink.cpu(), b.cpu(), SLOTS, offsets, rows)
    out = torch.empty(len(SLOTS), offsets[-1], device=DEVICE)
    lora_expand_delta(shrink, b, LoRAMapping(ts, triton=triton), offsets, out)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-3, atol=1e-3)


def test_shapes_that_do_not_fit_are_refused() -> None:
    shrink, b, ts, offsets, _ = _case((48, 48))
    mapping = LoRAMapping(ts)
    out = torch.empty(len(SLOTS), 96, device=DEVICE)
    with pytest.raises(ValueError, match="slice offsets"):
        lora_expand_delta(shrink, b, mapping, [0, 10, 20, 30, 96], out)
    with pytest.raises(ValueError, match="lora_b"):
        lora_expand_delta(shrink, b, mapping, [0, 48, 90], out)
    with pytest.raises(ValueError, match="float32"):
        lora_expand_delta(shrink, b, mapping, offsets, out.half())
    with pytest.raises(ValueError, match="shrink"):
        lora_expand_delta(shrink[:, :10], b, mapping, offsets, out)


# --- the fused epilogues fed the delta computed apart (``delta=``) against the same epilogues
# computing it from lora_b: what a step whose LoRA ran beside the base GEMM must produce


def _aug(widths, seed=3):
    """y_aug (T, N + R * S * L) of a real augmented GEMM (rank-major A rows), lora_b, slots."""
    g = torch.Generator().manual_seed(seed)
    n, s_count, k = sum(widths), len(widths), 32
    t = len(SLOTS)
    x = torch.randn(t, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    a = torch.randn(s_count, L, R, k, generator=g) / k**0.5
    rows = torch.cat([w, a.permute(2, 0, 1, 3).reshape(-1, k)])
    y_aug = (x @ rows.T).to(DEVICE)
    b = (torch.randn(L, R, n, generator=g) / 4).permute(0, 2, 1).to(DEVICE)
    ts = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    offsets = [0]
    for wd in widths:
        offsets.append(offsets[-1] + wd)
    return y_aug, b, ts, offsets


def _delta(y_aug, b, mapping, offsets):
    n = offsets[-1]
    out = torch.full((y_aug.shape[0], n), 7.0, device=DEVICE)
    out[torch.tensor(SLOTS, device=DEVICE) < 0] = 123.0  # rows of no adapter must not be read
    live = LoRAMapping(mapping.token_slots, triton=mapping.triton)
    d = torch.empty_like(out)
    lora_expand_delta(y_aug[:, n:], b, live, offsets, d)
    keep = torch.tensor(SLOTS, device=DEVICE) >= 0
    out[keep] = d[keep]
    return out


@pytest.mark.parametrize("triton", [False, True])
def test_silu_mul_fed_the_delta(triton: bool) -> None:
    from loraplex.engine.model.kernels import lora_silu_mul
    from loraplex.engine.model.kernels.silu_mul import SiluMulConfig, lora_silu_mul_triton

    i = 48
    y_aug, b, ts, offsets = _aug((i, i))
    mapping = LoRAMapping(ts, triton=triton)
    want = torch.empty(len(SLOTS), i, device=DEVICE)
    lora_silu_mul(y_aug, b, mapping, want)
    delta = _delta(y_aug, b, mapping, offsets)
    got = torch.empty_like(want)
    lora_silu_mul(y_aug[:, : 2 * i], None, mapping, got, delta=delta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if triton:  # a per-slot-loop config ignores its LoRA loop when fed the delta
        got2 = torch.empty_like(want)
        cfg = SiluMulConfig(16, 32, 4)
        lora_silu_mul_triton(y_aug[:, : 2 * i], None, mapping, got2, delta=delta, config=cfg)
        torch.testing.assert_close(got2, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("triton", [False, True])
def test_add_rmsnorm_fed_the_delta(triton: bool) -> None:
    from loraplex.engine.model.kernels import lora_add_rmsnorm
    from loraplex.engine.model.kernels.add_rmsnorm import NormConfig, lora_add_rmsnorm_triton

    h = 64
    y_aug, b, ts, offsets = _aug((h,))
    mapping = LoRAMapping(ts, triton=triton)
    g = torch.Generator().manual_seed(5)
    res0 = torch.randn(len(SLOTS), h, generator=g).to(DEVICE)
    w = torch.randn(h, generator=g).to(DEVICE)
    want_res, want = res0.clone(), torch.empty_like(res0)
    lora_add_rmsnorm(y_aug, want_res, b, mapping, w, 1e-5, want)
    delta = _delta(y_aug, b, mapping, offsets)
    configs = [None]
    if triton:  # the one-row kernel and the split one
        configs += [NormConfig(1, 32, 4), NormConfig(1, 32, 4, True), NormConfig(2, 16, 4, True)]
    for cfg in configs:
        res, got = res0.clone(), torch.empty_like(res0)
        if cfg is None:
            lora_add_rmsnorm(y_aug[:, :h], res, None, mapping, w, 1e-5, got, delta=delta)
        else:
            lora_add_rmsnorm_triton(y_aug[:, :h], res, None, mapping, w, 1e-5, got, delta=delta,
                                    config=cfg)  # fmt: skip
        torch.testing.assert_close(res, want_res, rtol=1e-5, atol=1e-5, msg=str(cfg))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(cfg))


@pytest.mark.parametrize("triton", [False, True])
def test_qkv_rope_fed_the_delta(triton: bool) -> None:
    from loraplex.engine.model.kernels import lora_qkv_rope
    from loraplex.engine.model.rope import RotaryEmbedding

    hq, hkv, d = 4, 2, 16
    y_aug, b, ts, offsets = _aug((hq * d, hkv * d, hkv * d))
    mapping = LoRAMapping(ts, triton=triton)
    t = len(SLOTS)
    rope = RotaryEmbedding(d, 64, 10000.0, None, DEVICE)
    pos = torch.arange(t, device=DEVICE) * 3 % 64
    smap = torch.arange(t, device=DEVICE) * 2
    smap[5] = -1  # a padded row writes nothing

    def run(y, lora_b, delta):
        kc = torch.zeros(t * 2 // 4 + 1, 4, hkv, d, device=DEVICE)
        vc, q = torch.zeros_like(kc), torch.empty(t, hq, d, device=DEVICE)
        lora_qkv_rope(y, lora_b, mapping, pos, rope.cos, rope.sin, kc, vc, smap, q, delta=delta)
        return q, kc, vc

    want = run(y_aug, b, None)
    got = run(y_aug[:, : offsets[-1]], None, _delta(y_aug, b, mapping, offsets))
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)


def test_delta_with_lora_b_or_of_a_wrong_shape_is_refused() -> None:
    from loraplex.engine.model.kernels import lora_silu_mul

    y_aug, b, ts, offsets = _aug((48, 48))
    mapping = LoRAMapping(ts)
    out = torch.empty(len(SLOTS), 48, device=DEVICE)
    delta = torch.zeros(len(SLOTS), 96, device=DEVICE)
    with pytest.raises(ValueError, match="one of them"):
        lora_silu_mul(y_aug, b, mapping, out, delta=delta)
    with pytest.raises(ValueError, match="float32"):
        lora_silu_mul(y_aug[:, :96], None, mapping, out, delta=delta[:, :90])
    with pytest.raises(ValueError, match="float32"):
        lora_silu_mul(y_aug[:, :96], None, mapping, out, delta=delta.half())
