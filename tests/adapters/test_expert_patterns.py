"""Per-expert ``rank_pattern`` / ``alpha_pattern`` in adapter_config.json (the per-expert
``target_modules`` form): experts of one adapter at other ranks and alphas, against a merged
reference (each expert's W + alpha_m / r_m * B A written into the HF base's fused experts; PEFT
cannot load this form on transformers 5's fused experts), logits within 1e-4 in float32 on the
reference forward, the GPU forward's twins and (Qwen3-MoE) its Triton kernels under the
interpreter; the slot holds each expert's own rank (zeros past it) and the slot's largest."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.slot_buffers import write_slot
from tests.helpers.models import make_peft_adapter, write_adapter
from tests.helpers.moe_models import MOE_KINDS, make_expert_adapter, make_tiny_moe, to_per_expert
from tests.helpers.peft_oracle import RTOL, hf_mixed_batch, ours, rel_err

pytest.importorskip("peft")

RANK, ALPHA = 8, 16
NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
KEY = re.compile(r"\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.lora_(A|B)\.weight$")


def _patterns(kind: str) -> tuple[dict[str, int], dict[str, float]]:
    gate, up, down = NAMES[kind]
    # expert 1's gate at rank 3 in every layer; expert 0's up at rank 5 with alpha 2.5 in
    # layer 1 only (a layer-qualified key, first in file order); expert 2's down at alpha 40
    ranks = {f"layers.1.{_parent(kind)}.experts.0.{up}": 5, f"experts.1.{gate}": 3}
    alphas = {f"layers.1.{_parent(kind)}.experts.0.{up}": 2.5, f"experts.2.{down}": 40.0}
    return ranks, alphas


def _parent(kind: str) -> str:
    return "block_sparse_moe" if kind == "mixtral" else "mlp"


def _rank_alpha(kind: str, layer: int, expert: int, name: str) -> tuple[int, float]:
    ranks, alphas = _patterns(kind)
    full = f"model.layers.{layer}.{_parent(kind)}.experts.{expert}.{name}"
    r = next((v for k, v in ranks.items() if full.endswith(k)), RANK)
    a = next((v for k, v in alphas.items() if full.endswith(k)), ALPHA)
    return r, a


def _patterned(per, out_dir, kind):
    """``per`` with each expert module cut to its pattern's rank and the patterns written."""
    config = json.loads((per / "adapter_config.json").read_text())
    ranks, alphas = _patterns(kind)
    config |= {"rank_pattern": ranks, "alpha_pattern": alphas}
    tensors = {}
    for key, t in load_file(per / "adapter_model.safetensors").items():
        m = KEY.search(key)
        if m is not None:
            r, _ = _rank_alpha(kind, int(m.group(1)), int(m.group(2)), m.group(3))
            t = t[:r] if m.group(4) == "A" else t[:, :r]
        tensors[key] = t.contiguous()
    return write_adapter(out_dir, config, tensors)


def _merged(model_dir, adapter, out_dir, kind):
    """The HF base with every expert's delta alpha_m / r_m * B A added to its weights."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors = load_file(adapter / "adapter_model.safetensors")
    gate, up, down = NAMES[kind]
    for key, a in tensors.items():
        m = KEY.search(key)
        if m is None or m.group(4) != "A":
            continue
        layer, expert, name = int(m.group(1)), int(m.group(2)), m.group(3)
        b = tensors[key.replace("lora_A", "lora_B")]
        r, alpha = _rank_alpha(kind, layer, expert, name)
        delta = (alpha / r) * (b.double() @ a.double())
        experts = model.model.layers[layer].mlp.experts
        with torch.no_grad():
            if name == down:
                experts.down_proj[expert] += delta.float()
            else:
                i = experts.gate_up_proj.shape[1] // 2
                lo = 0 if name == gate else i
                experts.gate_up_proj[expert, lo : lo + i] += delta.float()
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_tiny_moe(root / "base", kind, seed=1)
    twin = make_expert_adapter(model_dir, root / "twin", r=RANK, alpha=ALPHA, seed=12)
    pp = _patterned(to_per_expert(twin, root / "per", kind), root / "pp", kind)
    merged = _merged(model_dir, pp, root / "merged", kind)
    g = random.Random(8)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for n in (5, 9, 3)]
    attn = make_peft_adapter(merged, root / "attn", r=2, alpha=4, seed=13)
    ref_steps, ref_tokens = hf_mixed_batch(merged, {"attn": attn}, prompts, ["base"] * 3)
    return kind, model_dir, pp, prompts, ref_steps, ref_tokens


BACKENDS = {
    "torch": None,
    "fused_twins": KernelBackend(fused=True, triton=False),
    "fused": "fused",  # Triton kernels under the interpreter
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_per_expert_patterns_match_the_merged_reference(setup, backend):
    kind, model_dir, pp, prompts, ref_steps, ref_tokens = setup
    if backend == "fused" and (kind != "qwen3_moe" or torch.cuda.is_available()):
        pytest.skip("the interpreter is slow (Qwen3-MoE covers it); CPU tensors need it")
    kw = {} if BACKENDS[backend] is None else {"kernel_backend": BACKENDS[backend]}
    names = ["pp"] * len(prompts)
    our_steps = ours(model_dir, {"pp": pp}, prompts, names, ref_tokens, **kw)
    for step, (a, b) in enumerate(zip(our_steps, ref_steps, strict=True)):
        for row in range(len(prompts)):
            err = rel_err(a[row], b[row])
            assert err < RTOL, f"{kind} {backend} step {step} row {row}: {err:.2e}"
        assert a.argmax(-1).tolist() == ref_tokens[step]


def test_the_slot_holds_each_experts_rank(setup):
    kind, model_dir, pp, *_ = setup
    model = load_model(model_dir, dtype=torch.float32, device="cpu", max_loras=2, max_lora_rank=16)
    adapter = load_adapter(pp, model.cfg, max_lora_rank=16, name="pp", dtype=torch.float32)
    gate = NAMES[kind][0]
    layer, block = model.expert_loras()[0]
    w = adapter.weights[(layer, f"experts.1.{gate}")]
    assert w.a.shape[0] == 3 and adapter.rank == RANK
    raw = load_file(pp / "adapter_model.safetensors")
    b_key = next(k for k in raw if f"layers.{layer}." in k and f"experts.1.{gate}.lora_B" in k)
    torch.testing.assert_close(w.b, raw[b_key] * (ALPHA / 3))
    write_slot(model, 1, adapter, scatter="torch")
    assert block.ranks.tolist() == [0, RANK]
    bt = block.b_gate_up[1, 1]  # expert 1's B^T (R, 2I): gate columns 0 .. I, rank 3
    i = block.width
    assert float(bt[3:, :i].abs().sum()) == 0.0 and float(bt[:3, :i].abs().sum()) > 0
    assert float(bt[:RANK, i:].abs().sum()) > 0  # its up at rank 8
