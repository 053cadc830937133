"""fp8 base checkpoints through ``load_model``: tiny random models written in the published fp8
forms (``quant_method: fp8`` per tensor and per block, ``compressed-tensors`` per channel and per
tensor) and a float checkpoint quantized on load (``quantization="fp8"``).

Each projection must hold exactly the checkpoint's fp8 values times their scales (no
re-quantization), the fp8 values and row scales must be kept on the layer for the GPU path, and
everything else must load as it is stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.model import loader
from loraplex.engine.model.errors import UnsupportedQuantizationError
from loraplex.engine.model.loader import ModelLoadError, load_model
from loraplex.engine.model.quant import FP8_DTYPE, fp8_layers, fp8_weight, quantize_fp8
from tests.helpers.fp8 import (
    BLOCK,
    FORMS,
    ct_config,
    is_proj,
    write_fp8_checkpoint,
)
from tests.helpers.models import make_tiny_model

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}  # fmt: skip


def _expand(scale: torch.Tensor, rows: int, cols: int, form: str) -> torch.Tensor:
    """A stored scale as a (rows, cols) multiplier (the test's own reading of each layout)."""
    s = scale.float()
    if form == "fp8-block":
        return s.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)
    if s.numel() == rows:  # per channel
        return s.reshape(rows, 1).expand(rows, cols)
    return s.reshape(1, 1).expand(rows, cols)


def _target(model, key):
    """(LoRALinear, first row, last row) of a projection key."""
    parts = key.split(".")
    layer, module = model.layers[int(parts[2])], parts[-2]
    lin = getattr(layer, FUSED[module])
    s = lin.slice_index(module)
    return lin, lin.slice_offsets[s], lin.slice_offsets[s + 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fp8") / "base", kind="llama", seed=3)


@pytest.mark.parametrize("form", list(FORMS))
def test_fp8_checkpoint_loads_as_published(tiny, tmp_path, form):
    stored = write_fp8_checkpoint(tiny, tmp_path / form, form, split_scales=form == "fp8-block")
    model = load_model(tmp_path / form, dtype=torch.float32, device="cpu", max_loras=2)
    plain = load_file(tiny / "model.safetensors")
    assert len(fp8_layers(model)) == 4 * model.cfg.num_layers
    for key, (q, s) in stored.items():
        want = q.float() * _expand(s, *q.shape, form)
        if key == "lm_head.weight":  # de-quantized, no fp8 copy (not a projection)
            assert torch.equal(model.lm_head, want)
            continue
        lin, lo, hi = _target(model, key)
        assert torch.equal(lin.weight[lo:hi], want), key
        kept_q, kept_s = fp8_weight(lin)
        assert kept_q.dtype == FP8_DTYPE and kept_q.shape == (lin.out_features, lin.in_features)
        assert torch.equal(kept_q[lo:hi].view(torch.uint8), q.view(torch.uint8)), key  # the bits
        g = kept_s.shape[1]
        assert kept_s.dtype == torch.float32 and lin.in_features % g == 0
        per_element = kept_s[lo:hi].repeat_interleave(lin.in_features // g, 1)
        assert torch.equal(per_element, _expand(s, *q.shape, form)), key
        # the error against the float original is e4m3 rounding, not more
        err = (want - plain[key]).norm() / plain[key].norm()
        assert err < 0.05, f"{key}: {err:.3f}"
    assert torch.equal(model.embed_tokens, plain["model.embed_tokens.weight"])
    assert torch.equal(model.norm.weight, plain["model.norm.weight"])
    assert torch.equal(model.layers[1].input_layernorm.weight,
                       plain["model.layers.1.input_layernorm.weight"])  # fmt: skip
    if "lm_head.weight" not in stored:
        assert torch.equal(model.lm_head, plain["lm_head.weight"])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantization_fp8_quantizes_projections_on_load(tmp_path, kind):
    src = make_tiny_model(tmp_path / kind, kind=kind, seed=4)
    model = load_model(src, dtype=torch.float32, device="cpu", max_loras=1, quantization="fp8")
    plain = load_file(src / "model.safetensors")
    assert len(fp8_layers(model)) == 4 * model.cfg.num_layers
    for key, w in plain.items():
        if not is_proj(key):
            continue
        lin, lo, hi = _target(model, key)
        q, scale = quantize_fp8(w)
        kept_q, kept_s = fp8_weight(lin)
        assert torch.equal(kept_q[lo:hi].view(torch.uint8), q.view(torch.uint8)), key
        assert torch.equal(kept_s[lo:hi], scale[:, None]), key
        assert torch.equal(lin.weight[lo:hi], q.float() * scale[:, None]), key
    assert torch.equal(model.embed_tokens, plain["model.embed_tokens.weight"])
    if kind == "qwen2":  # biases stay float
        assert torch.equal(
            model.layers[0].qkv_proj.bias[:64], plain["model.layers.0.self_attn.q_proj.bias"]
        )


def test_on_load_quantization_equals_a_channel_checkpoint(tiny, tmp_path):
    """The same quantizer on load and in a compressed-tensors per-channel checkpoint."""
    write_fp8_checkpoint(tiny, tmp_path / "ct", "ct-channel")
    a = load_model(tmp_path / "ct", dtype=torch.float32, device="cpu")
    b = load_model(tiny, dtype=torch.float32, device="cpu", quantization="fp8")
    for la, lb in zip(fp8_layers(a), fp8_layers(b), strict=True):
        assert torch.equal(la.weight_aug, lb.weight_aug)
        assert torch.equal(la.weight_fp8.view(torch.uint8), lb.weight_fp8.view(torch.uint8))
        assert torch.equal(la.weight_scale, lb.weight_scale)


def test_plain_checkpoint_keeps_no_fp8(tiny):
    model = load_model(tiny, dtype=torch.float32, device="cpu")
    assert fp8_layers(model) == []


def test_bfloat16_model_from_fp8_checkpoint(tiny, tmp_path):
    stored = write_fp8_checkpoint(tiny, tmp_path / "b", "ct-channel")
    model = load_model(tmp_path / "b", dtype=torch.bfloat16, device="cpu")
    key = "model.layers.0.mlp.down_proj.weight"
    q, s = stored[key]
    lin, lo, hi = _target(model, key)
    assert lin.weight.dtype == torch.bfloat16
    assert torch.equal(lin.weight[lo:hi], (q.float() * s).to(torch.bfloat16))
    assert fp8_weight(lin)[1].dtype == torch.float32


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("qc", [{"quant_method": "gptq", "bits": 4}, {"quant_method": "awq"}])
def test_other_formats_fail_before_any_tensor_is_read(tiny, tmp_path, monkeypatch, qc):
    out = tmp_path / "q"
    out.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    save_file(load_file(tiny / "model.safetensors"), out / "model.safetensors")

    def no_reads(*a, **k):
        raise AssertionError("a tensor file was opened")

    monkeypatch.setattr(loader, "safe_open", no_reads)
    with pytest.raises(UnsupportedQuantizationError, match=repr(qc["quant_method"])):
        load_model(out, dtype=torch.float32, device="cpu")


def _edit(tiny: Path, out: Path, qc: dict | None, edit) -> Path:
    out.mkdir()
    cfg = json.loads((tiny / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(tiny / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


Q = "model.layers.0.self_attn.q_proj."
CT = ct_config("channel", ["lm_head"])


def _fp8_q_only(t, scale=True):
    q, s = quantize_fp8(t[Q + "weight"])
    t[Q + "weight"] = q
    if scale:
        t[Q + "weight_scale"] = s[:, None]


def test_missing_scale(tiny, tmp_path):
    out = _edit(tiny, tmp_path / "m", CT, lambda t: _fp8_q_only(t, scale=False))
    with pytest.raises(ModelLoadError, match="q_proj.weight is fp8 but the checkpoint has no"):
        load_model(out, dtype=torch.float32, device="cpu")


def test_fp8_tensors_without_quantization_config(tiny, tmp_path):
    out = _edit(tiny, tmp_path / "n", None, _fp8_q_only)
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        load_model(out, dtype=torch.float32, device="cpu")


def test_part_of_a_fused_projection_fp8(tiny, tmp_path):
    out = _edit(tiny, tmp_path / "p", CT, _fp8_q_only)  # q fp8, k and v float
    with pytest.raises(ModelLoadError, match="some but not all of q_proj/k_proj/v_proj"):
        load_model(out, dtype=torch.float32, device="cpu")


def test_e5m2_weights_refused(tiny, tmp_path):
    def e5m2(t):
        _fp8_q_only(t)
        t[Q + "weight"] = t[Q + "weight"].float().to(torch.float8_e5m2)

    out = _edit(tiny, tmp_path / "e", CT, e5m2)
    with pytest.raises(ModelLoadError, match="float8_e5m2 is not served"):
        load_model(out, dtype=torch.float32, device="cpu")


def test_scale_of_the_wrong_shape(tiny, tmp_path):
    def bad(t):
        _fp8_q_only(t)
        t[Q + "weight_scale"] = torch.ones(3, 1)

    out = _edit(tiny, tmp_path / "s", CT, bad)
    with pytest.raises(ModelLoadError, match="q_proj.weight_scale: scale of shape"):
        load_model(out, dtype=torch.float32, device="cpu")


def test_auto_dtype_of_an_fp8_checkpoint(tiny, tmp_path):
    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.model.loader import resolve_dtype

    write_fp8_checkpoint(tiny, tmp_path / "d", "ct-channel")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    for stored, want in (("float8_e4m3fn", torch.bfloat16), ("float16", torch.float16)):
        cfg = ModelConfig.from_dict({**raw, "torch_dtype": stored})
        assert resolve_dtype("auto", cfg, "cuda") == want
        assert resolve_dtype("auto", cfg, "cpu") == torch.float32
