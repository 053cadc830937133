"""preflight: adapter_config.json + safetensors header only, checked against the base model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.errors import (
    AdapterFormatError,
    AdapterRankError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterTooLargeError,
    LoRAError,
)
from tests.resolvers.tiny_adapter import tiny_model_config, write_adapter, write_raw_safetensors

MC = tiny_model_config()  # hidden 16, q 16, kv 8, intermediate 32, 2 layers
Q = "base_model.model.model.layers.0.self_attn.q_proj"
W = "adapter_model.safetensors"


def run(folder: Path, **kw: Any):
    kw.setdefault("max_lora_rank", 8)
    kw.setdefault("max_bytes", 1 << 20)
    return preflight(folder, MC, **kw)


def raw_adapter(tmp_path: Path, entries: dict[str, Any], data_len: int, **kw: Any) -> Path:
    """A folder whose weights file has exactly this header and ``data_len`` data bytes."""
    d = write_adapter(tmp_path / "raw", targets=("q_proj",))
    write_raw_safetensors(d / W, entries, b"\0" * data_len, **kw)
    return d


def qpair(
    a: tuple[int, int] = (0, 256), b: tuple[int, int] = (256, 512), dtype: str = "F32"
) -> dict:
    return {
        f"{Q}.lora_A.weight": {"dtype": dtype, "shape": [4, 16], "data_offsets": list(a)},
        f"{Q}.lora_B.weight": {"dtype": dtype, "shape": [16, 4], "data_offsets": list(b)},
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adapter_name", [None, "default"])
def test_good_adapter_passes(tmp_path: Path, dtype: torch.dtype, adapter_name: str | None) -> None:
    d = write_adapter(tmp_path / "a", dtype=dtype, adapter_name=adapter_name)
    rep = run(d)
    assert rep.rank == 4 and len(rep.modules) == 2 * 3  # 2 layers x (q, v, down)
    assert rep.modules[(1, "down_proj")].rank == 4
    assert rep.file_bytes == sum(p.stat().st_size for p in d.iterdir())
    assert (
        rep.tensor_bytes
        == sum(4 * (i + o) * dtype.itemsize for i, o in [(16, 16), (16, 8), (32, 16)]) * 2
    )


def test_raw_good_header_passes(tmp_path: Path) -> None:
    assert (
        run(raw_adapter(tmp_path, qpair(), 512)).modules[(0, "q_proj")].a_key.endswith("A.weight")
    )


def _fails(d: Path, error: type[LoRAError], match: str, **kw: Any) -> LoRAError:
    with pytest.raises(error, match=match) as ei:
        run(d, **kw)
    return ei.value


def test_truncated_file(tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a")
    size = (d / W).stat().st_size
    os.truncate(d / W, size - 10)
    _fails(d, AdapterFormatError, r"data_offsets .* outside the data section .*truncated")
    os.truncate(d / W, 20)  # cut inside the header
    _fails(d, AdapterFormatError, r"too short for its header \(truncated")
    os.truncate(d / W, 3)
    _fails(d, AdapterFormatError, "too short")


def test_overlapping_offsets(tmp_path: Path) -> None:
    e = _fails(raw_adapter(tmp_path, qpair(b=(200, 456)), 456), AdapterFormatError, "overlaps")
    assert e.field == f"{Q}.lora_B.weight"


def test_gap_between_tensors(tmp_path: Path) -> None:
    _fails(raw_adapter(tmp_path, qpair(b=(300, 556)), 556), AdapterFormatError, "gap of 44 bytes")


def test_trailing_bytes(tmp_path: Path) -> None:
    _fails(raw_adapter(tmp_path, qpair(), 600), AdapterFormatError, "tensors cover 512")


def test_oversized_header(tmp_path: Path) -> None:
    d = raw_adapter(tmp_path, qpair(), 512, header_len=(1 << 40))
    _fails(d, AdapterFormatError, "header length 1099511627776 is above the limit")
    _fails(
        raw_adapter(tmp_path, qpair(), 512),
        AdapterFormatError,
        "above the limit of 64",
        max_header_bytes=64,
    )


def test_bad_dtype(tmp_path: Path) -> None:
    d = raw_adapter(tmp_path, qpair(dtype="I32"), 512)
    e = _fails(d, AdapterShapeError, "dtype 'I32'; only F32, F16, BF16")
    assert e.field is not None and e.field.startswith(Q)


def test_byte_length_must_match_shape(tmp_path: Path) -> None:
    entries = qpair()
    entries[f"{Q}.lora_A.weight"]["shape"] = [4, 8]
    _fails(raw_adapter(tmp_path, entries, 512), AdapterFormatError, r"spans 256 bytes.*needs 128")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda e: e[f"{Q}.lora_A.weight"].pop("shape"), "no valid shape"),
        (lambda e: e[f"{Q}.lora_A.weight"].update(data_offsets=[0]), "no valid data_offsets"),
        (lambda e: e[f"{Q}.lora_A.weight"].update(shape=[4, -16]), "no valid shape"),
        (lambda e: e.update(__metadata__={"format": 1}), "__metadata__"),
    ],
)
def test_malformed_entries(tmp_path: Path, mutate: Any, match: str) -> None:
    entries = qpair()
    mutate(entries)
    _fails(raw_adapter(tmp_path, entries, 512), AdapterFormatError, match)


def test_invalid_or_duplicate_json(tmp_path: Path) -> None:
    d = raw_adapter(tmp_path, qpair(), 512)
    raw = (d / W).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n].decode()
    dup = header.replace("{", '{"' + Q + '.lora_A.weight": {}, ', 1).encode()
    (d / W).write_bytes(len(dup).to_bytes(8, "little") + dup + raw[8 + n :])
    _fails(d, AdapterFormatError, "duplicate key")
    (d / W).write_bytes((5).to_bytes(8, "little") + b"{nope" + b"\0" * 512)
    _fails(d, AdapterFormatError, "not valid JSON")


def test_rank_above_max(tmp_path: Path) -> None:
    e = _fails(
        write_adapter(tmp_path / "a", rank=16), AdapterRankError, "rank 16 .*above max_lora_rank 8"
    )
    assert e.field is not None and e.field.endswith("lora_A.weight")


def test_rank_disagrees_with_config(tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a", rank=4, config={"r": 2})
    _fails(d, AdapterShapeError, "has rank 4, but adapter_config.json gives")


def test_wrong_base_shape(tmp_path: Path) -> None:
    t = {f"{Q}.lora_A.weight": torch.zeros(4, 32), f"{Q}.lora_B.weight": torch.zeros(16, 4)}
    d = write_adapter(tmp_path / "a", targets=("q_proj",), tensors=t)
    _fails(d, AdapterShapeError, r"shape \(4, 32\), expected \(4, 16\)")


def test_missing_b(tmp_path: Path) -> None:
    d = write_adapter(
        tmp_path / "a", targets=("q_proj",), tensors={f"{Q}.lora_A.weight": torch.zeros(4, 16)}
    )
    _fails(d, AdapterShapeError, "no lora_B")


def test_over_quota(tmp_path: Path) -> None:
    _fails(
        write_adapter(tmp_path / "a"),
        AdapterTooLargeError,
        "above the quota of 1000",
        max_bytes=1000,
    )


def test_bin_only(tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a")
    (d / W).rename(d / "adapter_model.bin")
    _fails(d, AdapterFormatError, "safetensors required")


@pytest.mark.parametrize(
    ("key", "error", "match"),
    [
        ("base_model.model.lm_head.lora_A.weight", AdapterTargetError, "'lm_head'"),
        ("base_model.model.model.embed_tokens.weight", AdapterTargetError, "'model.embed_tokens'"),
        (
            "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight",
            AdapterTargetError,
            "layer 5",
        ),
        (
            "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight",
            AdapterTargetError,
            "not a LoRA module",
        ),
        (
            "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
            AdapterTargetError,
            "does not target",
        ),
        (f"{Q}.lora_magnitude_vector.weight", AdapterFormatError, "does not set use_dora"),
        (f"{Q}.lora_C.weight", AdapterFormatError, "not a LoRA A/B weight"),
    ],
)
def test_unknown_or_untargeted_modules(tmp_path: Path, key: str, error: type, match: str) -> None:
    t = {
        f"{Q}.lora_A.weight": torch.zeros(4, 16),
        f"{Q}.lora_B.weight": torch.zeros(16, 4),
        key: torch.zeros(4, 16),
    }
    _fails(write_adapter(tmp_path / "a", targets=("q_proj",), tensors=t), error, match)


def test_config_targets_checked(tmp_path: Path) -> None:
    d = write_adapter(tmp_path / "a", targets=("q_proj",))
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "norm"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    _fails(d, AdapterTargetError, "names 'norm'")


@pytest.mark.parametrize("dora", [False, True])
def test_a_magnitude_on_the_lm_head_is_refused_at_preflight_and_by_the_parser(
    tmp_path: Path, dora: bool
) -> None:
    """preflight and the parser read tensor names with the one parse_key: a DoRA magnitude on
    lm_head (which the parser once read as a magnitude where preflight refused the name) is a
    typed refusal in both."""
    from safetensors.torch import load_file

    from loraplex.engine.adapters.parse import load_adapter
    from loraplex.engine.errors import AdapterConfigError, AdapterFormatError
    from tests.resolvers.tiny_adapter import tiny_model_config, write_adapter

    mc = tiny_model_config()
    good = write_adapter(tmp_path / "good", targets=("q_proj",))
    tensors = load_file(good / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_magnitude_vector"] = torch.ones(mc.vocab_size)
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"], "use_dora": dora}
    bad = write_adapter(tmp_path / "bad", targets=("q_proj",), tensors=tensors, config=cfg)
    want = AdapterConfigError if dora else AdapterFormatError
    with pytest.raises(want):
        preflight(bad, mc, max_lora_rank=8, max_bytes=1 << 30)
    with pytest.raises(want):
        load_adapter(bad, mc, max_lora_rank=8)
