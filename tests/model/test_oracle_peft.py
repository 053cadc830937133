"""Mixed-adapter batches against HF transformers + PEFT (``adapter_names=[...]``).

Rows of one batch use the base model or one of three adapters that differ in rank, target
modules (attention only / all linear / regex), alpha, rsLoRA, rank_pattern and
layers_to_transform. Prefill logits and three decode steps must match in float32.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.full import attach_full_modules
from loraplex.engine.model.lora.slot_buffers import write_slot
from loraplex.engine.model_runner import ModelRunner, StepItem
from tests.helpers.models import make_peft_adapter, make_tiny_model

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
DECODE_STEPS = 3
RTOL = 1e-4


def half_ok(ours_err: float, peft_err: float) -> bool:
    """Half precision on the GPU against PEFT in float32: our error is of the order of the one
    PEFT itself makes in that precision on the same row (adapters with large deltas amplify
    rounding, in PEFT as in ours)."""
    return ours_err <= max(3 * peft_err, 1.5e-2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


MODEL_KINDS = {
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "qwen2": {},
    "mistral": dict(sliding_window=6),
}


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


def hf_mixed_batch(
    model_dir, adapters, prompts, names, dtype=torch.float32, device="cpu", force=None,
    prepare=None, active=None,
):  # fmt: skip
    """Prefill + greedy decode with PEFT; returns logits per step (B, V) and tokens.

    ``force``: decode these tokens (per step, per row) instead of the greedy ones.
    ``prepare(peft_model)``: called once the adapters are loaded (e.g. to add a weighted one).
    ``active``: run every row on this adapter, without ``adapter_names`` (PEFT refuses mixed
    batches with DoRA adapters).
    """
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    first, *rest = adapters
    model = peft.PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in rest:
        model.load_adapter(adapters[name], adapter_name=name)
    if prepare is not None:
        prepare(model)
    if active is not None:
        model.set_adapter(active)
    model.to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    hf_names = ["__base__" if n == "base" else n for n in names]
    steps, tokens = [], []
    past = None
    with torch.no_grad():
        for _ in range(DECODE_STEPS + 1):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=past,
                use_cache=True,
                **({"adapter_names": hf_names} if active is None else {}),
            )
            logits = out.logits[:, -1].float().cpu()
            steps.append(logits)
            nxt = logits.argmax(-1)
            if force is not None:
                nxt = torch.tensor(force[len(tokens)])
            tokens.append(nxt.tolist())
            past = out.past_key_values
            ids = nxt[:, None].to(device)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            pos = pos[:, -1:] + 1
    return steps, tokens


def ours(
    model_dir, adapters, prompts, names, hf_tokens, dtype=torch.float32, device="cpu",
    loaded=None, max_full=0, extra=0, max_rank=16, graphs=None, **runner_kw,
):  # fmt: skip
    """``adapters``: name -> folder, or (``loaded``) name -> a LoRAAdapter in ``dtype`` (or
    ``loaded(model)`` -> such a dict). ``max_full``: full-table slots (model/lora/full.py), slots
    0..max_full-1 (the last adapters: slots are taken in reverse order); ``extra``: their rows
    past the vocabulary (lora_extra_vocab_size, adapters that added tokens); ``max_rank``: the
    engine's max_lora_rank; ``graphs``: a list that gets, per step, whether it ran as a CUDA
    graph."""
    model = load_model(model_dir, dtype=dtype, device=device, max_loras=4, max_lora_rank=max_rank)
    attach_full_modules(model, max_full, extra)
    mc = replace(model.cfg, lora_extra_vocab_size=extra) if extra else model.cfg
    if callable(loaded):
        loaded = loaded(model)
    runner = ModelRunner(model, num_blocks=64, block_size=4, **runner_kw)
    slots = {}
    # NOTE: slots in reverse order so slot index != adapter order
    for slot, name in enumerate(reversed(list(loaded or adapters))):
        adapter = (loaded or {}).get(name) or load_adapter(
            adapters[name], mc, max_lora_rank=max_rank, name=name, dtype=dtype,
            full_modules=max_full > 0,
        )  # fmt: skip
        write_slot(model, slot, adapter)
        runner.slot_ranks.set(slot, adapter.rank, adapter.dora is not None)
        slots[name] = slot
    free = list(range(64))
    random.Random(0).shuffle(free)  # scattered blocks exercise the paging
    tables = []
    for p in prompts:
        need = (len(p) + DECODE_STEPS + 3) // 4
        tables.append([free.pop() for _ in range(need)])
    items = [
        StepItem(list(p), 0, tables[i], slots.get(names[i], -1)) for i, p in enumerate(prompts)
    ]
    steps = [runner.execute(items).cpu()]
    lens = [len(p) for p in prompts]
    for step in range(DECODE_STEPS):
        items = [
            StepItem([hf_tokens[step][i]], lens[i] + step, tables[i], slots.get(names[i], -1))
            for i in range(len(prompts))
        ]
        steps.append(runner.execute(items).cpu())
        if graphs is not None:
            graphs.append(runner.last_was_graph)
    return steps


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
