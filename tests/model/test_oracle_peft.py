"""Mixed-adapter batches against HF transformers + PEFT (``adapter_names=[...]``).

Rows of one batch use the base model or one of three adapters that differ in rank, target
modules (attention only / all linear / regex), alpha, rsLoRA, rank_pattern and
layers_to_transform. Prefill logits and three decode steps must match in float32.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.model.backend import KernelBackend
from tests.helpers.models import make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import (
    DECODE_STEPS,
    MODEL_KINDS,
    RTOL,
    hf_mixed_batch,
    ours,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ADAPTERS = {
    "attn4": dict(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all8rs": dict(
        r=8,
        alpha=32,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        layers_to_transform=[1],
    ),
    "regex16": dict(
        r=16,
        alpha=16,
        target_modules=r".*\.(q_proj|v_proj|up_proj|down_proj)",
        rank_pattern={"down_proj": 6},
        alpha_pattern={"v_proj": 48},
    ),
}
ROWS = [
    ("base", 5),
    ("attn4", 9),
    ("all8rs", 3),
    ("regex16", 12),
    ("attn4", 1),
    ("base", 9),
    ("regex16", 6),
]
SAME_PROMPT = (1, 5)  # an adapter row and a base row with one prompt


@pytest.fixture(scope="module", params=list(MODEL_KINDS))
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_tiny_model(root / "base", kind=kind, seed=1, **MODEL_KINDS[kind])
    adapters = {
        name: make_peft_adapter(model_dir, root / name, seed=10 + i, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    return kind, model_dir, adapters


def test_mixed_batch_matches_peft(setup):
    kind, model_dir, adapters = setup
    g = random.Random(3)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    prompts[SAME_PROMPT[1]] = list(prompts[SAME_PROMPT[0]])
    names = [n for n, _ in ROWS]
    hf_steps, hf_tokens = hf_mixed_batch(model_dir, adapters, prompts, names)
    our_steps = ours(model_dir, adapters, prompts, names, hf_tokens)
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(prompts)):
            err = ((a[row] - b[row]).norm() / b[row].norm()).item()
            assert err < RTOL, f"{kind} step {step} row {row} ({names[row]}): rel err {err:.2e}"
        assert a.argmax(-1).tolist() == hf_tokens[step]
    # the adapter must change the output: guards against a LoRA path that silently does nothing
    a, b = SAME_PROMPT
    diff = ((our_steps[0][a] - our_steps[0][b]).norm() / our_steps[0][b].norm()).item()
    assert diff > 1e-2, f"adapter row equals base row (rel diff {diff:.1e})"


BACKENDS = {  # kernel backends other than the CPU default (torch); Triton runs interpreted
    "fused_twins": KernelBackend(fused=True, triton=False),  # epilogues as their torch twins
    "fused": "fused",
    "sgmv": "sgmv",
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_kernel_backends_match_peft(setup, backend):
    """The GPU forward (augmented GEMMs, fused LoRA epilogues, paged attention kernels) on CPU:
    epilogues as torch twins or Triton, paged attention in Triton; and the reference forward
    with the Triton SGMV shrink / expand kernels."""
    kind, model_dir, adapters = setup
    if backend != "fused_twins" and kind != "llama":
        pytest.skip("the interpreter is slow: one model kind covers the Triton kernels")
    g = random.Random(9)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    names = [n for n, _ in ROWS]
    hf_steps, hf_tokens = hf_mixed_batch(model_dir, adapters, prompts, names)
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, kernel_backend=BACKENDS[backend]
    )
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(prompts)):
            err = ((a[row] - b[row]).norm() / b[row].norm()).item()
            assert err < RTOL, f"{kind} {backend} step {step} row {row}: rel err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_matches_peft_on_gpu(setup, dtype):
    """Half precision on CUDA (Triton kernels): against PEFT in float32 on the same GPU, our
    error is of the order of PEFT's own in the same half precision."""
    kind, model_dir, adapters = setup
    g = random.Random(4)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    names = [n for n, _ in ROWS]
    run = dict(model_dir=model_dir, adapters=adapters, prompts=prompts, names=names)
    ref_steps, ref_tokens = hf_mixed_batch(**run, dtype=torch.float32, device="cuda")
    hf_steps, _ = hf_mixed_batch(**run, dtype=dtype, device="cuda", force=ref_tokens)
    our_steps = ours(model_dir, adapters, prompts, names, ref_tokens, dtype=dtype, device="cuda")
    for step in range(DECODE_STEPS + 1):
        for row in range(len(prompts)):
            ref = ref_steps[step][row]
            ours_err = ((our_steps[step][row] - ref).norm() / ref.norm()).item()
            hf_err = ((hf_steps[step][row] - ref).norm() / ref.norm()).item()
            # both are half-precision implementations with roundings in different places
            assert ours_err <= max(3 * hf_err, 1.5e-2), (
                f"{kind} {dtype} step {step} row {row}: ours {ours_err:.2e} vs PEFT {hf_err:.2e}"
            )
            top2 = ref.topk(2).values
            if (top2[0] - top2[1]).item() > 1.0:  # a clear winner must agree
                assert int(our_steps[step][row].argmax()) == ref_tokens[step][row]


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(setup):
    """Decode through captured CUDA graphs gives the same logits as the eager fused path."""
    kind, model_dir, adapters = setup
    g = random.Random(6)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    names = [n for n, _ in ROWS]
    tokens = [[g.randrange(3, 200) for _ in ROWS] for _ in range(DECODE_STEPS + 1)]
    run = dict(dtype=torch.bfloat16, device="cuda")
    graph = ours(model_dir, adapters, prompts, names, tokens, **run, use_cuda_graphs=True)
    eager = ours(model_dir, adapters, prompts, names, tokens, **run, use_cuda_graphs=False)
    for step, (a, b) in enumerate(zip(graph, eager, strict=True)):
        assert torch.equal(a, b), f"{kind} step {step}: max diff {(a - b).abs().max().item()}"
