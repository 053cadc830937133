"""The CPU LoRA path over runs of rows (``add_lora_runs``) vs the torch reference ops, and the
mapping's run detection."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.lora.ops.reference import expand_torch, shrink_torch
from loraplex.engine.model.lora.ops.runs import add_lora_runs

# (token slots grouped by slot, slot ranks, R, slice widths, in_features)
CASES = {
    "one_slot_all_rows": ([1, 1, 1, 1], [4, 8], 8, (24, 8, 8), 32),
    "base_rows_then_slots": ([-1, -1, 0, 2, 2, 2, 3], [3, 16, 8, 1], 16, (32, 8, 8), 64),
    "one_slice": ([0, 0, 1], [8, 5], 8, (40,), 24),
    "zero_rank_slot": ([0, 1, 1], [0, 4], 4, (16, 16), 16),
    "single_token": ([2], [1, 1, 7], 8, (8, 8, 8), 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_runs_match_reference(case):
    slots, ranks, r, widths, k = CASES[case]
    g = torch.Generator().manual_seed(0)
    t, s, n = len(slots), len(widths), sum(widths)
    offsets = tuple(sum(widths[:i]) for i in range(s + 1))
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n, generator=g)
    a = torch.randn(s, len(ranks), r, k, generator=g)
    b = torch.randn(len(ranks), n, r, generator=g)
    mapping = LoRAMapping.build(slots, ranks)
    assert mapping.runs is not None
    ref = y.clone()
    buf = torch.zeros(s, t, r)
    shrink_torch(x, a, mapping, buf)
    expand_torch(ref, buf, b, offsets, mapping)
    out = y.clone()
    add_lora_runs(out, x, a, b, offsets, mapping.runs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    base = [i for i, sl in enumerate(slots) if sl < 0]
    assert torch.equal(out[base], y[base])


def test_runs_only_for_consecutive_rows():
    assert LoRAMapping.build([0, 1, 0], [4, 4]).runs is None
    assert LoRAMapping.build([0, -1, 0], [4]).runs is None
    m = LoRAMapping.build([-1, 1, 1, -1, 0], [4, 8])
    assert m.runs == ((0, 4, 1, 4), (1, 1, 2, 8))  # base rows between runs are fine


def test_runs_reject_half_precision():
    y = torch.zeros(2, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        add_lora_runs(y, y, torch.zeros(1, 1, 1, 4), torch.zeros(1, 4, 1), (0, 4), [(0, 0, 2, 1)])
