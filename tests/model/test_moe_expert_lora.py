"""LoRA on the experts (issue 42, phase 2) against HF transformers + PEFT: tiny Qwen3-MoE and
Mixtral, one mixed batch of base rows, an attention-only adapter and expert adapters in both
layouts (PEFT's target_parameters, and the per-expert form, whose oracle is PEFT on the same
weights in the fused form: this PEFT cannot load the per-expert form on transformers 5's fused
experts), prefill and decode; logits within float32 tolerance, greedy tokens identical. PEFT
refuses mixed batches with target_parameters, so its rows run per adapter (``hf_rows``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.moe.expert_lora import (
    ExpertLoRA,
    expert_lora_delta,
    expert_lora_delta_torch,
)
from loraplex.engine.model.moe.routing import sort_by_expert
from tests.helpers.models import make_peft_adapter
from tests.helpers.moe_models import MOE_KINDS, make_expert_adapter, make_tiny_moe, to_per_expert
from tests.helpers.peft_oracle import half_ok, hf_rows, ours, rel_err

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
    "fused": "fused",  # Triton kernels under the interpreter (expert LoRA's included)
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpu_forward_matches_peft(setup, backend):
    kind, model_dir, adapters, prompts, names, _, hf_tokens = setup
    if backend == "fused" and kind != "qwen3_moe":
        pytest.skip("the interpreter is slow: Qwen3-MoE covers it")
    if backend == "fused" and torch.cuda.is_available():
        pytest.skip("Triton on CPU tensors needs the interpreter: the GPU tests below cover it")
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, kernel_backend=BACKENDS[backend]
    )
    check(setup, our_steps, backend)


@pytest.mark.gpu
def test_gpu_forward_in_bfloat16_against_peft(setup):
    """bfloat16 on CUDA (the expert LoRA kernels, decode steps as CUDA graphs): against PEFT in
    float32 on the same GPU, our error is of the order of PEFT's own in bfloat16."""
    kind, model_dir, adapters, prompts, names, _, _ = setup
    twin = Path(adapters["per"]).parent / "twin"  # per's oracle: the fused form (setup)
    hf_adapters = {"attn": adapters["attn"], "fused": adapters["fused"], "per": twin}
    run = dict(model_dir=model_dir, adapters=hf_adapters, prompts=prompts, names=names)
    ref_steps, ref_tokens = hf_rows(**run, dtype=torch.float32, device="cuda")
    hf_steps, _ = hf_rows(**run, dtype=torch.bfloat16, device="cuda", force=ref_tokens)
    graphs: list[bool] = []
    our_steps = ours(
        model_dir, adapters, prompts, names, ref_tokens, dtype=torch.bfloat16, device="cuda",
        graphs=graphs,
    )  # fmt: skip
    assert graphs[1:] == [True] * (len(graphs) - 1), "decode steps ran eagerly"
    for step, ref_step in enumerate(ref_steps):
        for row in range(len(prompts)):
            ref = ref_step[row]
            err, hf_err = rel_err(our_steps[step][row], ref), rel_err(hf_steps[step][row], ref)
            assert half_ok(err, hf_err), f"{kind} step {step} row {row}: {err:.2e} vs {hf_err:.2e}"


@pytest.mark.gpu
def test_cuda_graph_decode_with_expert_adapters_equals_eager(setup):
    """Decode through captured CUDA graphs (padding rows routed too) gives the eager fused
    path's logits bit for bit, expert adapters in the batch."""
    kind, model_dir, adapters, prompts, names, _, _ = setup
    g = random.Random(6)
    tokens = [[g.randrange(3, 200) for _ in ROWS] for _ in range(4)]
    run = dict(dtype=torch.bfloat16, device="cuda")
    graphs: list[bool] = []
    graph = ours(model_dir, adapters, prompts, names, tokens, **run, graphs=graphs)
    eager = ours(model_dir, adapters, prompts, names, tokens, **run, use_cuda_graphs=False)
    assert graphs[1:] == [True] * (len(graphs) - 1)
    for step, (a, b) in enumerate(zip(graph, eager, strict=True)):
        assert torch.equal(a, b), f"{kind} step {step}: max diff {(a - b).abs().max().item()}"


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _case(dtype, slices, t, k, block_m, seed, big_r=8):
    """Random slots of 4 slots at max rank R: slot 0 rank R, 1 rank 3, 2 holds no experts (rank
    0, weights NaN: never read), 3 rank R // 2 + 1; weights past each slot's rank NaN."""
    g = torch.Generator().manual_seed(seed)
    num_slots, e, k_in, width = 4, 5, 40, 24
    ranks = torch.tensor([big_r, 3, 0, big_r // 2 + 1], dtype=torch.int32)
    a = torch.randn(num_slots, e, slices * big_r, k_in, generator=g)
    b = torch.randn(num_slots, e, big_r, slices * width, generator=g)  # B^T
    for s, r in enumerate(ranks.tolist()):
        for j in range(slices):
            a[s, :, j * big_r + r : (j + 1) * big_r] = float("nan")
        b[s, :, r:] = float("nan")
    a_div = k if slices == 2 else 1  # gate_up reads a token's row k times, down a pair's row
    x = torch.randn(t * k // a_div, k_in, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).reshape(-1)
    token_slots = torch.randint(-1, num_slots, (t,), generator=g)
    token_slots[: min(t, 5)] = torch.tensor([-1, 0, 1, 2, 3])[: min(t, 5)]
    out = torch.randn(t * k, slices * width, generator=g)
    out[token_slots.repeat_interleave(k) < 0, :3] = float("nan")  # base rows: bits kept
    to = dict(device=DEVICE)
    blocks = sort_by_expert(experts.to(DEVICE), e, block_m)
    args = (x.to(dtype), a.to(dtype), b.to(dtype), experts, token_slots, ranks)
    return [v.to(**to) for v in args], out.to(dtype).to(**to), blocks, a_div


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slices", [2, 1])
@pytest.mark.parametrize(
    ("t", "k", "block_m", "big_r"), [(7, 2, 16, 8), (40, 3, 16, 8), (3, 1, 64, 8), (9, 2, 16, 40)]
)
def test_triton_delta_matches_the_twin(dtype, slices, t, k, block_m, big_r):
    """The grouped kernels (shrink + expand over the expert-sorted blocks) against the twin:
    mixed slots (base rows, a slot without experts, ranks under the max), weights past a rank
    and a rank-0 slot's weights NaN (a kernel that read them would spread NaN), base rows' out
    NaN (a kernel that stored them would change them). Max rank 40: h in two shrink column tiles
    (gate_up) and the expand's rank in three chunks."""
    case = _case(dtype, slices, t, k, block_m, t, big_r)
    (x, a, b, experts, slots, ranks), out, blocks, a_div = case
    want, got = out.clone(), out.clone()
    expert_lora_delta_torch(x, a, b, experts, slots, ranks, want, a_div=a_div, top_k=k)
    expert_lora_delta(
        x, a, b, experts, slots, ranks, got, a_div=a_div, top_k=k, triton=True, blocks=blocks
    )
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
    skipped = (slots.repeat_interleave(k) < 0) | (slots.repeat_interleave(k) == 2)
    assert torch.equal(_bits(got[skipped]), _bits(out[skipped])), "skipped pairs keep their bits"
    assert not got[~skipped].isnan().any(), "every adapter pair's row computed, nothing NaN read"
    assert not torch.equal(got[~skipped], out[~skipped])


def test_triton_delta_without_adapter_pairs_leaves_out_alone():
    """All pairs base or of a slot without experts: out unchanged bit for bit."""
    (x, a, b, experts, slots, ranks), out, blocks, a_div = _case(torch.float32, 2, 6, 2, 16, 0)
    slots = torch.tensor([-1, 2, -1, 2, 2, -1], device=DEVICE)
    got = out.clone()
    expert_lora_delta(
        x, a, b, experts, slots, ranks, got, a_div=a_div, top_k=2, triton=True, blocks=blocks
    )
    assert torch.equal(_bits(got), _bits(out))


@pytest.mark.parametrize("triton", [False, True])
def test_slots_past_the_expert_capable_ones_read_no_expert_storage(triton):
    """max_expert_loras < max_loras: the buffers hold L = 4 slots, rows of LoRA slots 4 and 5
    (attention-only adapters there) get no delta, their out bits kept, nothing read past the
    buffers; every other row as with those rows made base rows."""
    (x, a, b, experts, slots, ranks), out, blocks, a_div = _case(torch.float32, 2, 8, 2, 16, 3)

    def poisoned(t: torch.Tensor, fill: float) -> torch.Tensor:
        """``t`` as the first rows of a buffer whose next two slots hold ``fill``: a kernel
        that read slot 4's or 5's weights would read NaN and spread it (the kernels loop over
        slots 0..L-1 only; their rank load masks slots past L)."""
        big = torch.full((t.shape[0] + 2, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        big[: t.shape[0]] = t
        return big[: t.shape[0]]

    a, b, ranks = poisoned(a, float("nan")), poisoned(b, float("nan")), poisoned(ranks, 8)
    slots = torch.tensor([4, 0, 5, 1, -1, 3, 4, 5], device=DEVICE)
    base = torch.where(slots >= 4, -1, slots)
    want, got = out.clone(), out.clone()
    expert_lora_delta_torch(x, a, b, experts, base, ranks, want, a_div=a_div, top_k=2)
    expert_lora_delta(
        x, a, b, experts, slots, ranks, got, a_div=a_div, top_k=2, triton=triton, blocks=blocks
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    past = (slots >= 4).repeat_interleave(2)
    assert torch.equal(_bits(got[past]), _bits(out[past]))
    assert not torch.equal(got[~past], out[~past])


def test_expert_writes_refuse_a_slot_without_expert_storage():
    """The expert slot writes never index past the expert-capable slots: a typed ValueError;
    a clear of such a slot is a no-op (it holds nothing)."""
    lora = ExpertLoRA(3, 8, 6, max_loras=1, max_rank=4, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="max_expert_loras"):
        lora.set(1, "gate", 0, torch.ones(2, 8), torch.ones(6, 2))
    with pytest.raises(ValueError, match="max_expert_loras"):
        lora.written(2, 4)
    lora.dirty.add(2)  # a write of unknown contents marks a slot dirty before it clears it
    lora.clear(2)
    assert lora.ranks.tolist() == [0] and not lora.dirty


def test_expert_lora_ranks_follow_set_and_clear():
    """``ranks`` holds each slot's largest expert rank; clear sets it to 0."""
    lora = ExpertLoRA(3, 8, 6, max_loras=2, max_rank=4, dtype=torch.float32, device="cpu")
    lora.set(1, "gate", 0, torch.ones(2, 8), torch.ones(6, 2))
    lora.set(1, "down", 2, torch.ones(3, 6), torch.ones(8, 3))
    assert lora.ranks.tolist() == [0, 3]
    lora.set(0, "gate_up", None, torch.ones(4 * 3, 8), torch.ones(12, 4 * 3))
    assert lora.ranks.tolist() == [4, 3]
    lora.clear(1)
    assert lora.ranks.tolist() == [4, 0] and float(lora.b_down[1].abs().sum()) == 0.0


@pytest.mark.parametrize("expert_slots", [0, 1])
def test_the_warm_up_layout_fits_the_expert_slots(tmp_path, expert_slots):
    """Start-up's warm write (the full layout into slot 0) on a MoE model with 0 expert-capable
    slots leaves the experts out (no slot can take them: a plan over them would fail); with
    some, slot 0 takes them."""
    from loraplex.engine.model.loader import load_model
    from loraplex.engine.model.lora.slot_buffers import SlotBuffers
    from loraplex.engine.model.lora.slot_image import PackedAdapter, full_layout
    from loraplex.engine.model.moe.lora_names import expert_module
    from loraplex.engine.warmup import warm_layout

    folder = make_tiny_moe(tmp_path / "moe", "qwen3_moe", seed=1)
    model = load_model(
        folder, dtype=torch.float32, device="cpu", max_loras=2, max_lora_rank=4,
        max_expert_loras=expert_slots,
    )  # fmt: skip
    entries, numel = warm_layout(model)
    assert numel == full_layout(model.cfg, 4)[1]
    has = any(expert_module(k[1]) is not None for k in entries)
    assert has == bool(expert_slots)
    packed = PackedAdapter(torch.ones(numel), entries, 4)
    buffers = SlotBuffers(model)
    buffers.prepare_plans(packed)
    buffers.write(0, packed, scatter="torch")
    assert [b.ranks.tolist() for _, b in model.expert_loras()] == [[4]] * len(model.expert_loras())
