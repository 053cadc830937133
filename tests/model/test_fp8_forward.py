"""The fp8 GEMM path of the forward: float base rows dropped (what CUDA runs), the A rows of
every slot in the same launch, on the reference and the fused forward.

CPU: against the same fp8 model with its float rows kept (de-quantized: the CPU slow path),
on the reference forward and the fused forward with its torch twins. GPU: the loader frees
the float rows; the fused forward (Triton fp8 GEMM + epilogues) against its torch twins, and
CUDA-graph decode against eager, bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.slot_buffers import write_slot
from loraplex.engine.model.quant import dequantize_fp8, drop_float_bases, fp8_layers
from loraplex.engine.model_runner import ModelRunner, StepItem
from tests.helpers.models import ALL_MODULES, make_peft_adapter, make_tiny_model

TWINS = KernelBackend(fused=True, triton=False)
NAMES = [None, "a", "b", "a", None, "b"]
STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8f")
    base = make_tiny_model(root / "base", kind="llama", seed=3)
    adapters = {
        "a": make_peft_adapter(base, root / "a", r=8, target_modules=ALL_MODULES, seed=31),
        "b": make_peft_adapter(base, root / "b", r=4, seed=32),
    }
    return base, adapters


def _load(base, device, dtype, drop):
    model = load_model(
        base, dtype=dtype, device=device, max_loras=2, max_lora_rank=8, quantization="fp8"
    )
    if drop:
        drop_float_bases(model)  # (the loader does this itself on CUDA)
    return model


def _run(model, adapters, dtype, forced=None, **runner_kw):
    """Logits (float32, CPU) of a prefill step and STEPS decode steps of mixed rows; decode
    feeds ``forced`` tokens (step -> row -> token) or, without them, the argmax."""
    runner = ModelRunner(model, num_blocks=48, block_size=4, **runner_kw)
    slots = {}
    for slot, name in enumerate(adapters):
        ad = load_adapter(adapters[name], model.cfg, max_lora_rank=8, name=name, dtype=dtype)
        write_slot(model, slot, ad)
        runner.slot_ranks.set(slot, ad.rank)
        slots[name] = slot
    g = random.Random(5)
    prompts = [[g.randrange(3, 200) for _ in range(g.randint(2, 9))] for _ in NAMES]
    tables = [list(range(i * 6, i * 6 + 6)) for i in range(len(NAMES))]
    rows = [slots.get(n, -1) for n in NAMES]
    items = [StepItem(list(p), 0, tables[i], rows[i]) for i, p in enumerate(prompts)]
    steps = [runner.execute(items).float().cpu()]
    for step in range(STEPS):
        toks = forced[step] if forced else steps[-1].argmax(-1).tolist()
        items = [
            StepItem([toks[i]], len(p) + step, tables[i], rows[i]) for i, p in enumerate(prompts)
        ]
        steps.append(runner.execute(items).float().cpu())
    return steps


def _tokens(steps):
    return [s.argmax(-1).tolist() for s in steps[:-1]]


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_drop_keeps_the_a_rows_and_the_weight(setup) -> None:
    base, _ = setup
    model = _load(base, "cpu", torch.float32, drop=False)
    lin = model.layers[0].qkv_proj
    float_rows = lin.weight.clone()
    lin.lora_a[1, 1, 2].normal_()
    a_rows = lin.weight_aug[lin.out_features :].clone()
    lin.drop_float_base()
    assert not lin.float_base and lin.weight_aug.shape == a_rows.shape
    assert torch.equal(lin.weight_aug, a_rows) and torch.equal(lin.shrink_rows, a_rows)
    assert lin.lora_a.data_ptr() == lin.weight_aug.data_ptr()  # slot writes land in the GEMM
    assert torch.equal(lin.weight, float_rows)  # de-quantized: what the float rows held
    assert torch.equal(lin.weight, dequantize_fp8(lin.weight_fp8, lin.weight_scale, torch.float32))
    assert len(fp8_layers(model)) == 8 and drop_float_bases(model) == 8


@pytest.mark.parametrize("backend", ["torch", "fused_twins"])
def test_fp8_gemm_path_matches_float_rows(setup, backend) -> None:
    base, adapters = setup
    kw = {"kernel_backend": TWINS} if backend == "fused_twins" else {"kernel_backend": "torch"}
    ref = _run(_load(base, "cpu", torch.float32, drop=False), adapters, torch.float32, **kw)
    forced = _tokens(ref)
    got = _run(_load(base, "cpu", torch.float32, drop=True), adapters, torch.float32, forced, **kw)
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert _rel(a, b) < 1e-5, f"step {step}: {_rel(a, b):.2e}"
    # the adapters are live on the fp8 path: rows of the same prompt length differ by adapter
    assert _rel(got[1][1], got[1][0]) > 1e-3


@pytest.mark.gpu
def test_cuda_load_frees_float_rows(setup) -> None:
    base, _ = setup
    model = _load(base, "cuda", torch.bfloat16, drop=False)
    layers = fp8_layers(model)
    assert len(layers) == 8
    for lin in layers:
        assert not lin.float_base and lin.weight_fp8.is_cuda
        assert lin.weight_aug.shape[0] == len(lin.slice_names) * 2 * 8  # A rows only


@pytest.mark.gpu
def test_triton_fp8_path_matches_its_twins(setup) -> None:
    base, adapters = setup
    ref = _run(_load(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16,
               kernel_backend=TWINS, use_cuda_graphs=False)  # fmt: skip
    forced = _tokens(ref)
    got = _run(_load(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16, forced,
               kernel_backend="fused", use_cuda_graphs=False)  # fmt: skip
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert _rel(a, b) < 2e-2, f"step {step}: {_rel(a, b):.2e}"


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(setup) -> None:
    base, adapters = setup
    graphs = _run(_load(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16,
                  kernel_backend="fused", use_cuda_graphs=True)  # fmt: skip
    eager = _run(_load(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16,
                 _tokens(graphs), kernel_backend="fused", use_cuda_graphs=False)  # fmt: skip
    for step, (a, b) in enumerate(zip(graphs, eager, strict=True)):
        assert torch.equal(a, b), f"step {step}: {_rel(a, b):.2e}"
