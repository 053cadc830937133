"""The scatter plan's table (model/lora/ops/scatter.py ``build_plan``): per view, per row, per BLOCK-wide
piece, against a plain loop over the same views; and the start-up helper that makes a
layout's two plans (with and without the zero-fill)."""

from __future__ import annotations

import torch

from loraplex.engine.bench.synthetic import LLAMA3_8B, random_model
from loraplex.engine.model.lora.ops.scatter import BLOCK, build_plan
from loraplex.engine.model.lora.slot_buffers import SlotBuffers
from loraplex.engine.model.lora.slot_image import PackedAdapter, full_layout


def reference_rows(views, base):
    """What the table must hold, row by row (the semantics of scatter.py's docstring)."""
    rows = []
    for view, stride, src in views:
        first = (view.data_ptr() - base.data_ptr()) // base.element_size()
        if view.is_contiguous():
            shape = [(first, view.numel())]
        else:
            shape = [(first + i * view.stride(0), view.shape[1]) for i in range(view.shape[0])]
        for i, (dst0, cols) in enumerate(shape):
            s0 = src + i * cols if src >= 0 else -1
            for lo in range(0, cols, BLOCK):
                rows.append([dst0 + lo, stride, s0 + lo if s0 >= 0 else -1, min(BLOCK, cols - lo)])
    return rows


def test_table_matches_a_plain_loop():
    base = torch.zeros(4, 3, 2 * BLOCK + 100)  # (slots, rows, long columns)
    other = base.view(4, -1)
    copies = [
        (base[0, :2], base.stride(0), 0),  # two whole rows: one contiguous run, five pieces
        (other[0, 5:17], other.stride(0), 50_000),  # contiguous, one short piece
        (base[0, 1:3, : BLOCK + 1], base.stride(0), 7),  # strided rows, two pieces each
    ]
    zeros = [(base[0, 2], base.stride(0))]
    plan = build_plan(copies, zeros, base)
    views = copies + [(v, s, -1) for v, s in zeros]
    want = reference_rows(views, base)
    assert plan.nblocks == len(want) == 5 + 1 + 4 + 3
    assert plan.table.tolist() == want


def test_empty_plan():
    base = torch.zeros(8)
    plan = build_plan([], [], base)
    assert plan.nblocks == 0 and tuple(plan.table.shape) == (0, 4)


def test_start_up_makes_both_plans_of_a_layout():
    cfg = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    model = random_model(cfg, max_loras=2, max_lora_rank=8, device="cpu", dtype=torch.float32)
    entries, numel = full_layout(model.cfg, 8)
    packed = PackedAdapter(torch.zeros(numel), entries, 8)
    buffers = SlotBuffers(model)
    buffers.prepare_plans(packed)
    keys = set(buffers._sites().plans)
    assert {(packed.layout, True), (packed.layout, False)} <= keys
