"""``lora_expand_delta``: every row's LoRA delta of a projection into an fp32 buffer (the form a
side stream computes beside the base GEMM). Triton (interpreted on CPU) and the twin against a
per-row loop over the rank-major shrink layout, at slices that split a column block, a rank
bound, rows of no adapter, and the shrink as the right-hand columns of an augmented GEMM."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.lora.mapping import LoRAMapping
from loraplex.engine.model.kernels.lora_expand_delta import ExpandDeltaConfig, lora_expand_delta

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
