"""LoRA on the experts (issue 42, phase 2) against HF transformers + PEFT: tiny Qwen3-MoE and
Mixtral, one mixed batch of base rows, an attention-only adapter and expert adapters in both
layouts (PEFT's target_parameters, and the per-expert form, whose oracle is PEFT on the same
weights in the fused form: this PEFT cannot load the per-expert form on transformers 5's fused
experts), prefill and decode; logits within float32 tolerance, greedy tokens identical. PEFT
refuses mixed batches with target_parameters, so its rows run per adapter (``hf_rows``)."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.moe.expert_lora import expert_lora_delta, expert_lora_delta_torch
from tests.helpers.models import make_peft_adapter
from tests.helpers.moe_models import MOE_KINDS, make_expert_adapter, make_tiny_moe, to_per_expert
from tests.helpers.peft_oracle import hf_rows, ours, rel_err

pytest.importorskip("peft")

ROWS = [("base", 5), ("attn", 9), ("fused", 3), ("per", 6), ("fused", 1), ("base", 7)]
SAME_PROMPT = (2, 5)  # an expert-adapter row and a base row with one prompt
RTOL = 1e-4


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_tiny_moe(root / "base", kind, seed=1)
    attn = make_peft_adapter(model_dir, root / "attn", r=4, alpha=8, seed=10)
    fused = make_expert_adapter(
        model_dir, root / "fused", r=4, alpha=8, target_modules=["q_proj", "o_proj"], seed=11
    )
    twin = make_expert_adapter(model_dir, root / "twin", r=8, alpha=16, seed=12)
    per = to_per_expert(twin, root / "per", kind)
    g = random.Random(3)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    prompts[SAME_PROMPT[1]] = list(prompts[SAME_PROMPT[0]])
    names = [n for n, _ in ROWS]
    hf_steps, hf_tokens = hf_rows(
        model_dir, {"attn": attn, "fused": fused, "per": twin}, prompts, names
    )
    adapters = {"attn": attn, "fused": fused, "per": per}
    return kind, model_dir, adapters, prompts, names, hf_steps, hf_tokens


def check(setup, our_steps, label: str) -> None:
    kind, _, _, prompts, names, hf_steps, hf_tokens = setup
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(prompts)):
            err = rel_err(a[row], b[row])
            assert err < RTOL, f"{kind} {label} step {step} row {row} ({names[row]}): {err:.2e}"
        assert a.argmax(-1).tolist() == hf_tokens[step], f"{kind} {label} step {step}"


def test_reference_forward_matches_peft(setup):
    _, model_dir, adapters, prompts, names, _, hf_tokens = setup
    our_steps = ours(model_dir, adapters, prompts, names, hf_tokens)
    check(setup, our_steps, "reference")
    a, b = SAME_PROMPT  # the expert adapter changes the output
    assert rel_err(our_steps[0][a], our_steps[0][b]) > 1e-2


BACKENDS = {
    "fused_twins": KernelBackend(fused=True, triton=False),
    "fused": "fused",  # Triton kernels under the interpreter (expert LoRA: its graph-safe form)
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpu_forward_matches_peft(setup, backend):
    kind, model_dir, adapters, prompts, names, _, hf_tokens = setup
    if backend == "fused" and kind != "qwen3_moe":
        pytest.skip("the interpreter is slow: Qwen3-MoE covers it")
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, kernel_backend=BACKENDS[backend]
    )
    check(setup, our_steps, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slices", [2, 1])
def test_graph_safe_delta_matches_the_twin(dtype, slices):
    """The host-sync-free form (CUDA graphs) against the (slot, expert)-grouped twin."""
    g = torch.Generator().manual_seed(0)
    num_slots, e, r, k_in, n, t, k = 3, 5, 4, 24, 16 * slices, 7, 2
    a = torch.randn(num_slots, e, slices * r, k_in, generator=g).to(dtype)
    b = torch.randn(num_slots, e, n, r, generator=g).to(dtype)
    x = torch.randn(t, k_in, generator=g).to(dtype)
    experts = torch.randint(0, e, (t * k,), generator=g)
    slots = torch.tensor([0, -1, 2, 1, -1, 0, 2])[:, None].expand(t, k).reshape(-1)
    base = torch.randn(t * k, n, generator=g).to(dtype)
    want, got = base.clone(), base.clone()
    expert_lora_delta_torch(x, a, b, experts, slots, want, a_div=k)
    expert_lora_delta(x, a, b, experts, slots, got, a_div=k, triton=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(want[slots < 0], base[slots < 0])
