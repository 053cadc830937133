"""Weights that no trained adapter has (NaN, Inf, |w| far above 1) are refused when the tensors
are parsed, with AdapterValueError naming the tensor, before an adapter could reach a slot.
Before, such adapters loaded and every request on them produced empty text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.parse import MAX_ADAPTER_WEIGHT, check_weight_values, load_adapter
from loraplex.engine.errors import AdapterFormatError, AdapterValueError
from tests.resolvers.tiny_adapter import tiny_model_config, write_adapter

W = "adapter_model.safetensors"
MC = tiny_model_config()


def poisoned(tmp_path: Path, which: str, value: float, dtype: torch.dtype = torch.float32) -> Path:
    good = write_adapter(tmp_path / "good", dtype=dtype)
    tensors = load_file(good / W)
    key = sorted(k for k in tensors if f".lora_{which}." in k)[-1]
    t = tensors[key].float()
    t[1, 2] = value
    tensors[key] = t.to(dtype)
    return write_adapter(tmp_path / f"bad-{which}", dtype=dtype, tensors=tensors)


@pytest.mark.parametrize("which", ["A", "B"])
@pytest.mark.parametrize(
    ("value", "match"),
    [
        (float("nan"), "1 NaN"),
        (float("inf"), "1 infinite"),
        (float("-inf"), "1 infinite"),
        (3e38, "magnitude 3e\\+38|infinite"),  # in B, x scale 2 overflows float32
        (-2e5, "magnitude [24]e\\+05"),
    ],
)
def test_garbage_values_are_refused(tmp_path: Path, which: str, value: float, match: str) -> None:
    d = poisoned(tmp_path, which, value)
    with pytest.raises(AdapterValueError, match=match) as ei:
        load_adapter(d, MC, max_lora_rank=16)
    assert ei.value.field is not None and f".lora_{which}." in ei.value.field
    assert isinstance(ei.value, AdapterFormatError)  # a malformed weight file, to callers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_files_are_checked_too(tmp_path: Path, dtype: torch.dtype) -> None:
    with pytest.raises(AdapterValueError, match="NaN"):
        load_adapter(poisoned(tmp_path, "B", float("nan"), dtype), MC, max_lora_rank=16)


def test_bound_applies_after_folding_the_scale(tmp_path: Path) -> None:
    """B entries of 1 are fine at scale 2, but not with lora_alpha making the scale 1e5; a scale
    that overflows float32 (alpha 1e300) gives Inf, refused too."""
    tensors = {
        k: (torch.ones_like(t) if ".lora_B." in k else t)
        for k, t in load_file(write_adapter(tmp_path / "g") / W).items()
    }
    ok = write_adapter(tmp_path / "ok", tensors=tensors)
    load_adapter(ok, MC, max_lora_rank=16)
    big = write_adapter(tmp_path / "big", tensors=tensors, config={"lora_alpha": 4e5})
    with pytest.raises(
        AdapterValueError, match="magnitude 1e\\+05 \\(LoRA scale 100000 folded in\\)"
    ):
        load_adapter(big, MC, max_lora_rank=16)
    huge = write_adapter(tmp_path / "huge", tensors=tensors, config={"lora_alpha": 1e300})
    with pytest.raises(AdapterValueError, match="infinite"):
        load_adapter(huge, MC, max_lora_rank=16)


def test_values_at_the_bound_load_and_cast_to_float16_finitely(tmp_path: Path) -> None:
    tensors = load_file(write_adapter(tmp_path / "g") / W)
    key = sorted(k for k in tensors if ".lora_A." in k)[0]
    tensors[key][0, 0] = -MAX_ADAPTER_WEIGHT
    d = write_adapter(tmp_path / "edge", tensors=tensors)
    adapter = load_adapter(d, MC, max_lora_rank=16, dtype=torch.float16)
    assert all(
        bool(torch.isfinite(w.a).all() and torch.isfinite(w.b).all())
        for w in adapter.weights.values()
    )


def test_check_is_one_reduction_on_good_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cheap on the common path: no finiteness pass unless the max already failed."""
    calls = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(1) or real(t))
    check_weight_values(torch.randn(64, 64), "k")
    check_weight_values(torch.empty(0, 8), "k")
    assert calls == []
    with pytest.raises(AdapterValueError):
        check_weight_values(torch.tensor([[1.0, float("nan")]]), "k")
    assert calls == [1]


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dst", [torch.bfloat16, torch.float16, torch.float32])
def test_fold_scale_and_folded_check_match_the_float32_fold_bit_for_bit(src, dst) -> None:
    from loraplex.engine.adapters.checks import check_folded_values, fold_scale_into

    g = torch.Generator().manual_seed(0)
    b = (torch.randn(512, 16, generator=g) * torch.logspace(-8, 2, 16)).to(src)
    for scale in (1.0, 2.0, 0.5, 2**-0.5, 1 / 3, 16 / 7, -0.75, 100.0):
        ref = (b.float() * scale).to(dst)
        got = torch.empty(b.shape[1], b.shape[0], dtype=dst).t()  # a packed B^T block's view
        fold_scale_into(got, b, scale)
        assert got.dtype == dst and torch.equal(got, ref)
        # the check bounds the folded values without making them: same verdict either way
        peak = float((b.float() * scale).abs().amax())
        if peak <= MAX_ADAPTER_WEIGHT:
            check_folded_values(b, "k", scale)
        else:
            with pytest.raises(AdapterValueError, match="LoRA scale"):
                check_folded_values(b, "k", scale)


def test_folded_check_refuses_nan_inf_and_the_scale_that_crosses_the_bound() -> None:
    from loraplex.engine.adapters.checks import check_folded_values

    b = torch.full((8, 4), 5e3, dtype=torch.bfloat16)
    check_folded_values(b, "k", 2.0)  # 1e4: at the bound
    with pytest.raises(AdapterValueError, match="above"):
        check_folded_values(b, "k", 2.5)
    for bad in (float("nan"), float("inf"), float("-inf")):
        c = b.clone()
        c[3, 1] = bad
        with pytest.raises(AdapterValueError, match="NaN|infinite"):
            check_folded_values(c, "k", 1.0)


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stage_file_packs_the_same_image_as_load_then_pack(
    tmp_path: Path, file_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    """The loader's stage writes each tensor from the file straight into the slot image; the
    image must equal, bit for bit, parsing the adapter and packing it (the path the CPU oracle
    tests cover), for a scale that is not a power of two and a rank below the slots'."""
    from loraplex.engine.adapters.staging import stage_file
    from loraplex.engine.model.lora.slot_image import pack_adapter

    config = {"r": 4, "lora_alpha": 7, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    folder = write_adapter(tmp_path / "a", dtype=file_dtype, config=config)
    ref = pack_adapter(load_adapter(folder, MC, max_lora_rank=8, dtype=dtype), 8)
    out = torch.full((ref.buffer.numel() + 100,), 7.0, dtype=dtype)
    adapter = stage_file(str(folder), MC, 8, dtype=dtype, out=out)
    got = adapter.image
    assert got is not None and got.entries == ref.entries
    n = ref.buffer.numel()
    assert got.buffer.data_ptr() == out.data_ptr() and got.buffer.numel() == n
    for e in ref.entries.values():  # (alignment gaps are never read)
        assert torch.equal(got.a(e), ref.a(e)) and torch.equal(got.b(e), ref.b(e))
    assert torch.equal(out[n:], torch.full((100,), 7.0, dtype=dtype))
    w = adapter.weights[(0, "q_proj")]  # the adapter reads the image
    assert w.a.data_ptr() == got.a(got.entries[(0, "q_proj")]).data_ptr()


def test_stage_file_refuses_a_poisoned_file_like_the_parser(tmp_path: Path) -> None:
    from loraplex.engine.adapters.staging import stage_file

    out = torch.zeros(1 << 16)
    for which in ("A", "B"):
        bad = poisoned(tmp_path / which, which, float("nan"))
        with pytest.raises(AdapterValueError, match="NaN"):
            stage_file(str(bad), MC, 8, dtype=torch.float32, out=out)


def test_the_parser_reads_only_the_lora_tensors_of_a_file(tmp_path: Path) -> None:
    """A/B are read with one read per run of adjacent tensors; a table between them (e.g. a
    modules_to_save embedding of ~1 GB at 8B scale) is never read with them."""
    from safetensors.torch import save_file

    from loraplex.engine.adapters.files import FileTensors, read_safetensors_header

    tensors = {
        "a1": torch.randn(4, 16),
        "a2": torch.randn(4, 8).to(torch.bfloat16),
        "m_table": torch.randn(1000, 16),  # sorts between the a* and b* keys
        "z1": torch.randn(16, 4).to(torch.float16),
    }
    save_file(tensors, str(tmp_path / W))
    header = read_safetensors_header(tmp_path / W, max_header_bytes=1 << 20)
    data = FileTensors(tmp_path / W, header, ["z1", "a1", "a2"])
    assert data.buf.numel() == sum(tensors[k].nbytes for k in ("a1", "a2", "z1"))
    for k in ("a1", "a2", "z1"):
        assert torch.equal(data[k], tensors[k])


def test_file_tensors_views_keep_their_buffer_and_misaligned_ones_are_copied(
    tmp_path: Path,
) -> None:
    import gc

    from loraplex.engine.adapters.files import FileTensors, read_safetensors_header
    from tests.resolvers.tiny_adapter import write_raw_safetensors

    # bf16 "a" (3 values, 6 bytes) first: the float32 "b" after it starts 2 bytes off alignment
    a, b = torch.randn(3).to(torch.bfloat16), torch.randn(5, 2)
    header = {
        "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "b": {"dtype": "F32", "shape": [5, 2], "data_offsets": [6, 46]},
    }
    raw = a.view(torch.uint8).numpy().tobytes() + b.view(torch.uint8).numpy().tobytes()
    write_raw_safetensors(tmp_path / W, header, raw)
    data = FileTensors(
        tmp_path / W, read_safetensors_header(tmp_path / W, max_header_bytes=1 << 20), ["a", "b"]
    )
    views = {"a": data["a"], "b": data["b"]}
    del data
    gc.collect()
    assert torch.equal(views["a"], a) and torch.equal(views["b"], b)
