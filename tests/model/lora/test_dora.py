"""DoRA adapters (PEFT ``use_dora=True``) against PEFT: logits of a batch mixing base rows,
plain LoRA rows and DoRA rows within 1e-4 in float32 (qwen2: q/k/v biases), on the reference
forward and the fused forward; the row scale's twin; typed refusals."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.checks import fold_dora
from loraplex.engine.adapters.parse import load_adapter, load_magnitudes
from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.errors import AdapterConfigError, AdapterFormatError, AdapterShapeError
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.dora import row_scales
from loraplex.engine.model.lora.ops.dora import apply_dora
from loraplex.engine.model.lora.slot_buffers import clear_slot, write_slot
from tests.helpers.adapters import make_dora_adapter
from tests.helpers.models import copy_adapter, make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import DECODE_STEPS, RTOL, half_ok, hf_mixed_batch, ours, rel_err

pytest.importorskip("peft")

ROWS = [("base", 5), ("dora", 9), ("plain", 4), ("dora", 3), ("base", 7), ("plain", 2)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dora")
    model_dir = make_tiny_model(root / "base", kind="qwen2", seed=4)
    adapters = {
        "dora": make_dora_adapter(
            model_dir,
            root / "dora",
            seed=7,
            r=6,
            alpha=12,
            target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        ),  # fmt: skip
        "plain": make_peft_adapter(model_dir, root / "plain", seed=8, r=4, alpha=8),
    }
    return model_dir, adapters


def _loaded(adapters):
    def load(model):
        out = {}
        for name, path in adapters.items():
            a = load_adapter(path, model.cfg, max_lora_rank=16, name=name)
            mags = load_magnitudes(path, model.cfg)
            if mags:
                fold_dora(a, row_scales(model, a.name, a.weights, mags))
            out[name] = a
        return out

    return load


@pytest.mark.parametrize("backend", ["torch", "fused_twins", "fused"])
def test_dora_matches_peft_in_a_mixed_batch(setup, backend):
    model_dir, adapters = setup
    g = random.Random(2)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    names = [n for n, _ in ROWS]
    # PEFT takes no mixed batch with a DoRA adapter: its rows run as a batch of their own
    d_rows = [i for i, n in enumerate(names) if n == "dora"]
    p_rows = [i for i, n in enumerate(names) if n != "dora"]
    hf_d, tok_d = hf_mixed_batch(
        model_dir, {"dora": adapters["dora"]}, [prompts[i] for i in d_rows],
        ["dora"] * len(d_rows), active="dora",
    )  # fmt: skip
    hf_p, tok_p = hf_mixed_batch(
        model_dir, {"plain": adapters["plain"]}, [prompts[i] for i in p_rows],
        [names[i] for i in p_rows],
    )  # fmt: skip
    hf_steps, hf_tokens = [], []
    for step in range(DECODE_STEPS + 1):
        logits = torch.empty(len(ROWS), hf_d[step].shape[1])
        toks = [0] * len(ROWS)
        for rows, steps, tokens in ((d_rows, hf_d, tok_d), (p_rows, hf_p, tok_p)):
            for j, i in enumerate(rows):
                logits[i] = steps[step][j]
                toks[i] = tokens[step][j]
        hf_steps.append(logits)
        hf_tokens.append(toks)
    kw = {
        "torch": {},
        "fused_twins": dict(kernel_backend=KernelBackend(fused=True, triton=False)),
        "fused": dict(kernel_backend="fused"),  # the Triton epilogues (interpreted on CPU)
    }
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, loaded=_loaded(adapters), **kw[backend]
    )
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(ROWS)):
            err = ((a[row] - b[row]).norm() / b[row].norm()).item()
            assert err < RTOL, f"{backend} step {step} row {row} ({names[row]}): rel err {err:.2e}"
    # DoRA is not its plain LoRA: the same adapter without the row scale differs
    plain_hf, _ = hf_mixed_batch(
        model_dir, {"dora": adapters["dora"]}, [prompts[d_rows[0]]], ["dora"], active="dora",
        prepare=lambda m: _drop_dora(m),
    )  # fmt: skip
    diff = ((plain_hf[0][0] - our_steps[0][d_rows[0]]).norm() / plain_hf[0][0].norm()).item()
    assert diff > 1e-3


def _drop_dora(model):
    for mod in model.modules():
        if hasattr(mod, "use_dora") and mod.use_dora.get("dora"):
            mod.use_dora["dora"] = False
            mod.lora_variant.pop("dora", None)


def test_row_scale_twin():
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(4, 6, generator=g) + 0.5  # 3 slots + the base row (index -1)
    scale[-1] = 1.0
    y = torch.randn(5, 6, generator=g)
    bias = torch.randn(6, generator=g)
    slots = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32)
    want = torch.stack([scale[int(s)] * (y[t] - bias) + bias for t, s in enumerate(slots)])
    got = y.clone()
    apply_dora(got, scale, bias, slots)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got[1], y[1])  # a base row keeps its value


def test_slot_writes_keep_the_dora_flags(setup):
    """The fused epilogues scale only the rows of flagged slots (``LoRALinear.dora_on``): a
    DoRA adapter's write flags exactly the projections it targets and fills their scales; a
    plain adapter or a clear in the same slot resets flags and scales."""
    model_dir, adapters = setup
    model = load_model(model_dir, dtype=torch.float32, device="cpu", max_loras=3, max_lora_rank=16)
    dora = _loaded(adapters)(model)
    layer = model.layers[0]
    lins = {m: getattr(layer, m) for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    write_slot(model, 1, dora["dora"])  # targets q, v, o, up, down: every projection
    for name, lin in lins.items():
        assert lin.dora_on.tolist() == [0, 1, 0, 0], name
        assert not torch.equal(lin.dora_scale[1], torch.ones_like(lin.dora_scale[1])), name
    k = lins["qkv_proj"].slice_index("k_proj")
    lo, hi = lins["qkv_proj"].slice_offsets[k : k + 2]
    assert torch.equal(lins["qkv_proj"].dora_scale[1, lo:hi], torch.ones(hi - lo))  # untargeted
    for reset in (lambda: write_slot(model, 1, dora["plain"]), lambda: clear_slot(model, 1)):
        write_slot(model, 1, dora["dora"])
        reset()
        for name, lin in lins.items():
            assert lin.dora_on.tolist() == [0, 0, 0, 0], name
            assert torch.equal(lin.dora_scale, torch.ones_like(lin.dora_scale)), name


def test_dora_refusals(setup, tmp_path):
    model_dir, adapters = setup
    mc = ModelConfig.from_dir(model_dir)
    tensors = load_file(adapters["dora"] / "adapter_model.safetensors")
    no_mag = {k: v for k, v in tensors.items() if "magnitude" not in k}
    bad = copy_adapter(adapters["dora"], tmp_path / "no-mag", tensors=no_mag)
    for check in (
        lambda: load_adapter(bad, mc, max_lora_rank=16),
        lambda: preflight(bad, mc, max_lora_rank=16, max_bytes=None),
    ):
        with pytest.raises(AdapterFormatError, match="no lora_magnitude_vector"):
            check()
    stray = copy_adapter(adapters["dora"], tmp_path / "stray", use_dora=False)
    with pytest.raises(AdapterFormatError, match="does not set use_dora"):
        load_adapter(stray, mc, max_lora_rank=16)
    key = next(k for k in tensors if "magnitude" in k)
    short = {**tensors, key: tensors[key][:-1]}
    short_dir = copy_adapter(adapters["dora"], tmp_path / "short", tensors=short)
    for check in (
        lambda: load_adapter(short_dir, mc, max_lora_rank=16),
        lambda: preflight(short_dir, mc, max_lora_rank=16, max_bytes=None),
    ):
        with pytest.raises(AdapterShapeError, match="magnitude"):
            check()
    yes = copy_adapter(adapters["dora"], tmp_path / "s", use_dora="yes")
    with pytest.raises(AdapterConfigError, match="use_dora"):
        load_adapter(yes, mc, max_lora_rank=16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dora_mixed_batch_on_gpu(setup, dtype):
    """The fused path on CUDA in half precision, decode steps with DoRA rows as CUDA graphs
    (the row scale inside the captured epilogues): against PEFT in float32 on the same GPU,
    per row group."""
    model_dir, adapters = setup
    g = random.Random(6)
    prompts = [[g.randrange(3, 200) for _ in range(n)] for _, n in ROWS]
    names = [n for n, _ in ROWS]
    d_rows = [i for i, n in enumerate(names) if n == "dora"]
    p_rows = [i for i, n in enumerate(names) if n != "dora"]
    groups = (
        (d_rows, {"dora": adapters["dora"]}, dict(active="dora")),
        (p_rows, {"plain": adapters["plain"]}, {}),
    )
    tokens = [[0] * len(ROWS) for _ in range(DECODE_STEPS + 1)]
    refs = [[None] * len(ROWS) for _ in range(DECODE_STEPS + 1)]
    peft_err = [[0.0] * len(ROWS) for _ in range(DECODE_STEPS + 1)]
    for rows, folders, kw in groups:
        batch = ([prompts[i] for i in rows], [names[i] for i in rows])
        ref, toks = hf_mixed_batch(model_dir, folders, *batch, device="cuda", **kw)
        # PEFT itself in the same half precision, on the same tokens: the noise floor
        half, _ = hf_mixed_batch(
            model_dir, folders, *batch, dtype=dtype, device="cuda", force=toks, **kw
        )
        for step in range(DECODE_STEPS + 1):
            for j, i in enumerate(rows):
                tokens[step][i], refs[step][i] = toks[step][j], ref[step][j]
                peft_err[step][i] = rel_err(half[step][j], ref[step][j])
    graphs: list[bool] = []
    our_steps = ours(
        model_dir, adapters, prompts, names, tokens, dtype=dtype, device="cuda",
        loaded=_loaded(adapters), graphs=graphs,
    )  # fmt: skip
    assert graphs and all(graphs), f"decode steps with DoRA rows ran eagerly: {graphs}"
    eager = ours(
        model_dir, adapters, prompts, names, tokens, dtype=dtype, device="cuda",
        loaded=_loaded(adapters), use_cuda_graphs=False,
    )  # fmt: skip
    for step, (a, b) in enumerate(zip(our_steps, eager, strict=True)):
        assert torch.equal(a, b), f"step {step}: the graph and the eager step differ"
    for step in range(DECODE_STEPS + 1):
        for row in range(len(ROWS)):
            ref = refs[step][row]
            err, floor = rel_err(our_steps[step][row], ref), peft_err[step][row]
            assert half_ok(err, floor), (
                f"{dtype} step {step} row {row} ({names[row]}): rel err {err:.2e} "
                f"(PEFT in {dtype}: {floor:.2e})"
            )
            top2 = ref.topk(2).values
            if (top2[0] - top2[1]).item() > 1.0:
                assert int(our_steps[step][row].argmax()) == tokens[step][row]
