"""fp8 weights (model/quant.py): the round trip's error bound, scale layouts, the config forms
read and refused."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.errors import ModelConfigError, UnsupportedQuantizationError
from loraplex.engine.model.quant import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Format,
    dequantize_fp8,
    parse_quantization_config,
    quantize_fp8,
    row_scales,
)
from tests.helpers.models import TINY_CONFIG

# e4m3: 3 mantissa bits, so a normal value rounds to within 2^-4 of itself; below the smallest
# normal (2^-6) the spacing is 2^-9, so the absolute error is at most 2^-10 (in units of scale)
REL = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # row scales
    w[5] = 0.0  # a zero row
    w[7, 3] = 250.0  # an outlier
    w[9] = torch.randn(96, generator=g) * 1e-30  # tiny values
    return w


def test_round_trip_error_within_e4m3_rounding():
    w = _weights()
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    back = dequantize_fp8(q, scale[:, None], torch.float32)
    assert torch.isfinite(back).all()
    bound = torch.maximum(w.abs() * REL, scale[:, None] * SUBNORMAL_ABS)
    err = (back - w).abs()
    assert (err <= bound * (1 + 1e-6)).all(), f"worst excess {(err - bound).max().item():.3e}"
    # each row's largest value maps to +-448: no range is wasted, nothing saturates
    assert torch.equal(q.float().abs().amax(1)[scale > 0], torch.full((47,), FP8_MAX))
    rel = ((back - w).norm(dim=1) / w.norm(dim=1).clamp(min=1e-38))[scale > 0]
    assert rel.max() < 0.04


def test_zero_row_stays_zero():
    w = torch.zeros(3, 8)
    w[1] = torch.arange(8.0)
    q, scale = quantize_fp8(w)
    assert scale[0] == 0 and scale[2] == 0
    assert torch.equal(q[0].float(), torch.zeros(8))
    assert torch.equal(dequantize_fp8(q, scale[:, None], torch.float32)[[0, 2]], torch.zeros(2, 8))


def test_quantize_accepts_half_precision_and_dequantizes_to_dtype():
    w = _weights().to(torch.bfloat16)
    q, scale = quantize_fp8(w)
    back = dequantize_fp8(q, scale[:, None], torch.bfloat16)
    assert back.dtype == torch.bfloat16
    ref = dequantize_fp8(q, scale[:, None], torch.float32)
    assert torch.equal(back, ref.to(torch.bfloat16))


def test_dequantize_with_column_groups():
    q = torch.randn(4, 6).to(FP8_DTYPE)
    scale = torch.tensor([[1.0, 2.0, 3.0]]).expand(4, 3)  # groups of 2 columns
    want = q.float() * torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0])
    assert torch.equal(dequantize_fp8(q, scale, torch.float32), want)


# --- scale layouts ------------------------------------------------------------------------

FMT_ALL = Fp8Format("x", ("tensor", "channel", "group"), ("weight_scale",), group_size=4)


@pytest.mark.parametrize("stored", [torch.tensor(0.5), torch.tensor([0.5])])
def test_per_tensor_scale_repeats_over_rows(stored):
    assert torch.equal(row_scales(stored, 3, 8, FMT_ALL), torch.full((3, 1), 0.5))


@pytest.mark.parametrize("shape", [(3,), (3, 1)])
def test_per_channel_scale(shape):
    s = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16).reshape(shape)
    out = row_scales(s, 3, 8, FMT_ALL)
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([[1.0], [2.0], [3.0]]))


def test_group_scale():
    s = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(row_scales(s, 3, 8, FMT_ALL), s)


def test_block_scale_repeats_over_block_rows():
    fmt = Fp8Format("fp8", ("block",), ("weight_scale_inv",), block=(2, 4))
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # a 3x8 weight: ceil(3/2) x 8/4 blocks
    want = torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(row_scales(s, 3, 8, fmt), want)
    with pytest.raises(ValueError, match="multiple of the block width"):
        row_scales(torch.ones(2, 3), 3, 10, fmt)


def test_scale_of_no_layout_is_refused():
    only_tensor = Fp8Format("fp8", ("tensor",), ("weight_scale",))
    with pytest.raises(ValueError, match="fits no tensor layout of a 3x8 weight"):
        row_scales(torch.ones(3, 1), 3, 8, only_tensor)


# --- config.json forms --------------------------------------------------------------------


def test_no_quantization_config():
    assert parse_quantization_config(None) is None


def test_fp8_method_per_tensor_and_block():
    fmt = parse_quantization_config({"quant_method": "fp8", "activation_scheme": "static"})
    assert fmt.strategies == ("tensor",) and set(fmt.scale_keys) == {
        "weight_scale",
        "weight_scale_inv",
    }
    block = parse_quantization_config(
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    )
    assert block.strategies == ("block",) and block.block == (128, 128)


def _ct(strategy="channel", fmt="float-quantized", **weights):
    w = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
         "dynamic": False, **weights}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": w,
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                    "symmetric": True,
                },
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("fmt", ["float-quantized", "naive-quantized"])
def test_compressed_tensors_fp8(strategy, fmt):
    got = parse_quantization_config(_ct(strategy, fmt))
    assert got.method == "compressed-tensors" and got.strategies == (strategy,)
    assert got.scale_keys == ("weight_scale",)


def test_compressed_tensors_block_and_group():
    got = parse_quantization_config(_ct("block", block_structure=[128, 128]))
    assert got.block == (128, 128)
    assert parse_quantization_config(_ct("group", group_size=64)).group_size == 64


REFUSED = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    "awq": ({"quant_method": "awq", "bits": 4}, "'awq'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    "no method": ({"bits": 4}, "without quant_method"),
    "int8 compressed-tensors": (
        _ct("channel", "int-quantized", type="int"),
        "format 'int-quantized'",
    ),
    "int8 weights": (_ct("channel", "naive-quantized", type="int"), "8-bit int weights"),
    "w4a16": (_ct("group", "pack-quantized", num_bits=4, type="int"), "'pack-quantized'"),
    "nvfp4": (_ct("tensor_group", "nvfp4-pack-quantized", num_bits=4), "'nvfp4-pack-quantized'"),
    "asymmetric": (_ct("channel", symmetric=False), "asymmetric"),
    "e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    "sparse": ({**_ct(), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_quantizations_are_refused_by_name(case):
    qc, named = REFUSED[case]
    with pytest.raises(UnsupportedQuantizationError, match=named) as e:
        parse_quantization_config(qc)
    assert isinstance(e.value, ModelConfigError)


def test_model_config_reads_the_format():
    raw = dict(TINY_CONFIG, model_type="llama", architectures=["LlamaForCausalLM"],
               rope_theta=10000.0, rms_norm_eps=1e-6)  # fmt: skip
    assert ModelConfig.from_dict(raw).quantization is None
    cfg = ModelConfig.from_dict({**raw, "quantization_config": _ct()})
    assert cfg.quantization is not None and cfg.quantization.strategies == ("channel",)
    with pytest.raises(UnsupportedQuantizationError, match="'awq'"):
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "awq"}})
