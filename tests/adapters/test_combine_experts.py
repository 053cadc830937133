"""Compositions (combine.py) of adapters with LoRA on the experts: a weighted combination of two
expert adapters (PEFT's fused form, or the per-expert form) in a slot against a merged reference
(PEFT's ``merge_and_unload`` of each component, its B scaled by its weight, one after another:
W + sum_i w_i s_i B_i A_i; PEFT's ``add_weighted_adapter`` refuses ``target_parameters``),
logits within 1e-4 in float32 on the reference forward, the GPU forward's twins and (Qwen3-MoE)
its Triton kernels under the interpreter; the fused layout of the sum expert by expert; mixed
expert layouts refused."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.combine import combine_adapters
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.errors import AdapterConfigError
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.loader import load_model
from tests.helpers.models import copy_adapter, make_peft_adapter
from tests.helpers.moe_models import MOE_KINDS, make_expert_adapter, make_tiny_moe, to_per_expert
from tests.helpers.peft_oracle import RTOL, hf_mixed_batch, ours, rel_err

pytest.importorskip("peft")

WEIGHTS = {"fx": 0.7, "fy": -1.3}
PROMPT_LENS = [5, 9, 3, 6]


def _merged(model_dir, components, out_dir):
    """The base with each component merged in, its B scaled by its weight (PEFT)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for path, w in components:
        tensors = {
            k: t * w if ".lora_B." in k else t
            for k, t in load_file(path / "adapter_model.safetensors").items()
        }
        scaled = copy_adapter(path, out_dir / f"scaled_{path.name}", tensors=tensors)
        model = peft.PeftModel.from_pretrained(model, scaled).merge_and_unload()
    model.save_pretrained(out_dir / "merged")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / f).exists():
            (out_dir / "merged" / f).write_bytes((model_dir / f).read_bytes())
    return out_dir / "merged"


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    model_dir = make_tiny_moe(root / "base", kind, seed=1)
    fx = make_expert_adapter(
        model_dir, root / "fx", r=4, alpha=8, target_modules=["q_proj", "o_proj"], seed=11
    )
    fy = make_expert_adapter(model_dir, root / "fy", r=2, alpha=6, seed=12)
    paths = {
        "fx": fx, "fy": fy,
        "px": to_per_expert(fx, root / "px", kind), "py": to_per_expert(fy, root / "py", kind),
    }  # fmt: skip
    merged = _merged(model_dir, [(fx, WEIGHTS["fx"]), (fy, WEIGHTS["fy"])], root)
    g = random.Random(4)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS]
    names = ["base"] * len(prompts)
    # the merged model as the base of a PEFT model whose rows run without an adapter
    attn = make_peft_adapter(merged, root / "attn", r=2, alpha=4, seed=13)
    ref_steps, ref_tokens = hf_mixed_batch(merged, {"attn": attn}, prompts, names)
    return kind, model_dir, paths, prompts, ref_steps, ref_tokens


def _combo(model_dir, paths, names):
    mc = load_model(model_dir, dtype=torch.float32, device="cpu").cfg
    parts = {n: load_adapter(paths[n], mc, max_lora_rank=16, name=n) for n in names}
    return combine_adapters(
        [(parts[n], WEIGHTS["f" + n[1]]) for n in names], name="combo", max_lora_rank=16
    ), parts


BACKENDS = {
    "torch": None,
    "fused_twins": KernelBackend(fused=True, triton=False),
    "fused": "fused",  # Triton kernels under the interpreter
}


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_expert_combination_matches_the_merged_reference(setup, layout, backend):
    kind, model_dir, paths, prompts, ref_steps, ref_tokens = setup
    if backend == "fused" and (kind != "qwen3_moe" or torch.cuda.is_available()):
        pytest.skip("the interpreter is slow (Qwen3-MoE covers it); CPU tensors need it")
    combo, _ = _combo(model_dir, paths, ["fx", "fy"] if layout == "fused" else ["px", "py"])
    assert combo.rank == 6
    names = ["combo"] * len(prompts)
    kw = {} if BACKENDS[backend] is None else {"kernel_backend": BACKENDS[backend]}
    our_steps = ours(model_dir, paths, prompts, names, ref_tokens, loaded={"combo": combo}, **kw)
    for step, (a, b) in enumerate(zip(our_steps, ref_steps, strict=True)):
        for row in range(len(prompts)):
            err = rel_err(a[row], b[row])
            assert err < RTOL, f"{kind} {layout} {backend} step {step} row {row}: {err:.2e}"
        assert a.argmax(-1).tolist() == ref_tokens[step]


def test_fused_expert_combination_is_the_weighted_sum_expert_by_expert(setup):
    _, model_dir, paths, *_ = setup
    combo, parts = _combo(model_dir, paths, ["fx", "fy"])
    key = next(k for k in combo.weights if k[1] == "experts.gate_up_proj")
    got, x, y = combo.weights[key], parts["fx"].weights[key], parts["fy"].weights[key]
    n_exp = got.experts
    assert n_exp == x.experts > 1 and got.a.shape[0] == 6 * n_exp

    def delta(lw, e):  # expert e's B @ A in PEFT's fused layout
        r = lw.a.shape[0] // n_exp
        return lw.b.view(lw.b.shape[0], r, n_exp)[:, :, e] @ lw.a.view(n_exp, r, -1)[e]

    for e in range(n_exp):
        want = WEIGHTS["fx"] * delta(x, e) + WEIGHTS["fy"] * delta(y, e)
        torch.testing.assert_close(delta(got, e), want)
    # attention modules of fx alone keep fx's rank
    assert combo.weights[(0, "q_proj")].a.shape[0] == 4


def test_mixed_expert_layouts_are_refused(setup):
    _, model_dir, paths, *_ = setup
    with pytest.raises(AdapterConfigError, match="fused expert form .* per-expert form") as ei:
        _combo(model_dir, paths, ["fx", "py"])
    assert ei.value.field == "adapters"
