"""The fp8 GEMM path of the forward: float base rows dropped (what CUDA runs), the A rows of
every slot in the same launch, on the reference and the fused forward.

CPU: against the same fp8 model with its float rows kept (de-quantized: the CPU slow path),
on the reference forward and the fused forward with its torch twins. GPU: the loader frees
the float rows; the fused forward (Triton fp8 GEMM + epilogues) against its torch twins, and
CUDA-graph decode against eager, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.quant import dequantize_fp8, drop_float_bases, fp8_layers
from tests.helpers.fp8 import (
    TWINS,
    argmax_tokens,
    load_fp8,
    make_fp8_case,
    rel_norm,
    run_fp8_rows,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_fp8_case(tmp_path_factory.mktemp("fp8f"))


def test_drop_keeps_the_a_rows_and_the_weight(setup) -> None:
    base, _ = setup
    model = load_fp8(base, "cpu", torch.float32, drop=False)
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
    ref = run_fp8_rows(
        load_fp8(base, "cpu", torch.float32, drop=False), adapters, torch.float32, **kw
    )
    forced = argmax_tokens(ref)
    got = run_fp8_rows(
        load_fp8(base, "cpu", torch.float32, drop=True), adapters, torch.float32, forced, **kw
    )
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert rel_norm(a, b) < 1e-5, f"step {step}: {rel_norm(a, b):.2e}"
    # the adapters are live on the fp8 path: rows of the same prompt length differ by adapter
    assert rel_norm(got[1][1], got[1][0]) > 1e-3


@pytest.mark.gpu
def test_cuda_load_frees_float_rows(setup) -> None:
    base, _ = setup
    model = load_fp8(base, "cuda", torch.bfloat16, drop=False)
    layers = fp8_layers(model)
    assert len(layers) == 8
    for lin in layers:
        assert not lin.float_base and lin.weight_fp8.is_cuda
        assert lin.weight_aug.shape[0] == len(lin.slice_names) * 2 * 8  # A rows only


@pytest.mark.gpu
def test_triton_fp8_path_matches_its_twins(setup) -> None:
    base, adapters = setup
    ref = run_fp8_rows(load_fp8(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16,
               kernel_backend=TWINS, use_cuda_graphs=False)  # fmt: skip
    forced = argmax_tokens(ref)
    got = run_fp8_rows(load_fp8(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16, forced,
               kernel_backend="fused", use_cuda_graphs=False)  # fmt: skip
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert rel_norm(a, b) < 2e-2, f"step {step}: {rel_norm(a, b):.2e}"


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(setup) -> None:
    base, adapters = setup
    graphs = run_fp8_rows(load_fp8(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16,
                  kernel_backend="fused", use_cuda_graphs=True)  # fmt: skip
    eager = run_fp8_rows(load_fp8(base, "cuda", torch.bfloat16, False), adapters, torch.bfloat16,
                 argmax_tokens(graphs), kernel_backend="fused", use_cuda_graphs=False)  # fmt: skip
    for step, (a, b) in enumerate(zip(graphs, eager, strict=True)):
        assert torch.equal(a, b), f"step {step}: {rel_norm(a, b):.2e}"
