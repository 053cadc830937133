"""A combination (combine.py) in a slot against PEFT's ``add_weighted_adapter(...,
combination_type="cat")``: logits of a mixed batch (base rows, plain adapter rows, rows on the
combination) within 1e-4 in float32, on the reference forward and on the fused forward (its
epilogues as torch twins; a combination is an adapter with per-module ranks, whose Triton
kernels tests/model/test_oracle_peft.py covers)."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.adapters.combine import combine_adapters
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.errors import AdapterRankError, AdapterValueError
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.loader import load_model
from tests.helpers.models import make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import RTOL, half_ok, hf_mixed_batch, ours, rel_err

pytest.importorskip("peft")

ADAPTERS = {
    "attn4": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "mlp6": dict(r=6, alpha=24, target_modules=["gate_proj", "up_proj", "q_proj"], seed=3),
    "rs8": dict(r=8, alpha=16, use_rslora=True, target_modules=["v_proj", "down_proj"]),
}
ROWS = [("base", 5), ("combo", 9), ("attn4", 4), ("combo", 3), ("rs8", 7), ("base", 2)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("combine")
    model_dir = make_tiny_model(root / "base", kind="llama", seed=2)
    adapters = {
        name: make_peft_adapter(model_dir, root / name, **{"seed": 20 + i, **kw})
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    return model_dir, adapters


def _loaded(model_dir, adapters, names, weights):
    mc = load_model(model_dir, dtype=torch.float32, device="cpu").cfg
    parts = {n: load_adapter(adapters[n], mc, max_lora_rank=16, name=n) for n in adapters}
    combo = combine_adapters(
        [(parts[n], w) for n, w in zip(names, weights, strict=True)],
        name="combo",
        max_lora_rank=16,
    )
    return {"attn4": parts["attn4"], "rs8": parts["rs8"], "combo": combo}, parts


@pytest.mark.parametrize("backend", ["torch", "fused_twins"])
def test_combination_matches_peft_cat(setup, backend):
    model_dir, adapters = setup
    # PEFT scales a cat sum by sqrt(total rank) when the first component uses rsLoRA (its
    # config is copied): rs8 comes last so the sum is the plain weighted sum
    names, weights = ["attn4", "mlp6", "rs8"], [0.6, -0.5, 1.5]
    loaded, _ = _loaded(model_dir, adapters, names, weights)
    assert loaded["combo"].rank == 12  # per module: q 4 + 6, v 4 + 8, o 4, gate 6, down 8
    g = random.Random(5)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    rows = [n for n, _ in ROWS]

    def prepare(model):
        model.add_weighted_adapter(names, weights, "combo", combination_type="cat")

    hf_steps, hf_tokens = hf_mixed_batch(model_dir, adapters, prompts, rows, prepare=prepare)
    kw = {
        "torch": {},
        "fused_twins": dict(kernel_backend=KernelBackend(fused=True, triton=False)),
    }[backend]
    our_steps = ours(model_dir, adapters, prompts, rows, hf_tokens, loaded=loaded, **kw)
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(prompts)):
            err = ((a[row] - b[row]).norm() / b[row].norm()).item()
            assert err < RTOL, f"{backend} step {step} row {row} ({rows[row]}): rel err {err:.2e}"
    # the combination differs from each of its components
    assert not torch.allclose(our_steps[0][1], our_steps[0][2], rtol=1e-2)


def test_combination_layout_and_refusals(setup):
    model_dir, adapters = setup
    loaded, parts = _loaded(model_dir, adapters, ["attn4", "rs8"], [2.0, 0.5])
    combo = loaded["combo"]
    # v_proj: both; o_proj: attn4 only (no padding rows); down_proj: rs8 only
    assert combo.weights[(0, "v_proj")].a.shape[0] == 12
    assert combo.weights[(0, "o_proj")].a.shape[0] == 4
    assert combo.weights[(1, "down_proj")].a.shape[0] == 8
    a4, r8 = parts["attn4"].weights[(0, "v_proj")], parts["rs8"].weights[(0, "v_proj")]
    want = 2.0 * a4.b @ a4.a + 0.5 * r8.b @ r8.a
    got = combo.weights[(0, "v_proj")]
    torch.testing.assert_close(got.b @ got.a, want)
    with pytest.raises(AdapterRankError, match="rank 12 .* above max_lora_rank 8"):
        combine_adapters([(parts["attn4"], 1.0), (parts["rs8"], 1.0)], name="x", max_lora_rank=8)
    with pytest.raises(AdapterValueError, match="weighted"):
        combine_adapters([(parts["attn4"], 1e9)], name="x", max_lora_rank=16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combination_on_gpu(setup, dtype):
    """The fused path on CUDA (Triton epilogues, CUDA graphs) in half precision against PEFT's
    cat combination in float32 on the same GPU."""
    model_dir, adapters = setup
    names, weights = ["attn4", "mlp6", "rs8"], [0.6, -0.5, 1.5]
    loaded, _ = _loaded(model_dir, adapters, names, weights)
    g = random.Random(7)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    rows = [n for n, _ in ROWS]

    def prepare(model):
        model.add_weighted_adapter(names, weights, "combo", combination_type="cat")

    ref_steps, ref_tokens = hf_mixed_batch(
        model_dir, adapters, prompts, rows, device="cuda", prepare=prepare
    )
    half_steps, _ = hf_mixed_batch(  # PEFT itself in the same precision: the noise floor
        model_dir, adapters, prompts, rows, dtype=dtype, device="cuda", prepare=prepare,
        force=ref_tokens,
    )  # fmt: skip
    our_steps = ours(
        model_dir, adapters, prompts, rows, ref_tokens, dtype=dtype, device="cuda", loaded=loaded
    )
    for step, (a, b) in enumerate(zip(our_steps, ref_steps, strict=True)):
        for row in range(len(prompts)):
            err, floor = rel_err(a[row], b[row]), rel_err(half_steps[step][row], b[row])
            assert half_ok(err, floor), (
                f"{dtype} step {step} row {row} ({rows[row]}): rel err {err:.2e} "
                f"(PEFT in {dtype}: {floor:.2e})"
            )
            top2 = b[row].topk(2).values
            if (top2[0] - top2[1]).item() > 1.0:
                assert int(a[row].argmax()) == ref_tokens[step][row]
