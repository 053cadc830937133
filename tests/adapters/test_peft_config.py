"""adapter_config.json as hostile JSON: deep nesting, huge numbers and huge values give a typed
AdapterConfigError (a 4xx at the admin route), never RecursionError or ValueError (a 500, or a
crash at start-up for ``--lora-modules``). One parser serves preflight and load_adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.adapters.peft_config import parse_peft_config, parse_peft_config_json
from loraplex.engine.adapters.preflight import preflight, read_safetensors_header
from loraplex.engine.errors import AdapterConfigError, AdapterFormatError
from tests.resolvers.tiny_adapter import tiny_model_config, write_adapter

MC = tiny_model_config()
C = "adapter_config.json"
GOOD = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def nested(depth: int) -> bytes:
    return b'{"peft_type": "LORA", "target_modules": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = {
    "nested-1k": nested(1_000),
    "nested-100k": nested(100_000),
    "nested-object": b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    "nested-900-value": json.dumps({**GOOD, "lora_alpha": [[[[[[[[[[1]]]]]]]]]]}).encode(),
    "int-5000-digits": b'{"peft_type": "LORA", "r": ' + b"9" * 5000 + b"}",
    "not-utf8": b'{"peft_type": "\xff"}',
    "not-json": b"{peft_type: LORA}",
    "top-level-list": b"[]",
}


@pytest.mark.parametrize("case", HOSTILE)
def test_parser_gives_typed_errors(case: str) -> None:
    with pytest.raises(AdapterConfigError) as ei:
        parse_peft_config_json(HOSTILE[case])
    assert len(str(ei.value)) < 500  # values are quoted cut short


@pytest.mark.parametrize("case", ["nested-1k", "nested-100k", "int-5000-digits"])
@pytest.mark.parametrize("check", ["preflight", "load_adapter"])
def test_loaders_give_typed_errors(tmp_path: Path, case: str, check: str) -> None:
    d = write_adapter(tmp_path / "a")
    (d / C).write_bytes(HOSTILE[case])
    with pytest.raises(AdapterConfigError):
        if check == "preflight":
            preflight(d, MC, max_lora_rank=16, max_bytes=None)
        else:
            load_adapter(d, MC, max_lora_rank=16)


def test_huge_values_are_quoted_short() -> None:
    for key, value in [
        ("r", "x" * 100_000),
        ("lora_alpha", [1] * 100_000),
        ("bias", {"k" * 1000: "v"}),
        ("use_dora", "y" * 10_000),
    ]:
        with pytest.raises(AdapterConfigError) as ei:
            parse_peft_config({**GOOD, key: value})
        assert key in str(ei.value) and len(str(ei.value)) < 500


def test_nested_safetensors_header_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    header = b"[" * 200_000 + b"]" * 200_000
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(AdapterFormatError, match="nested too deeply"):
        read_safetensors_header(path, max_header_bytes=1 << 20)


def test_good_config_bytes_still_parse() -> None:
    cfg = parse_peft_config_json(json.dumps(GOOD).encode())
    assert cfg.r == 4 and cfg.target_modules == ("q_proj",)
