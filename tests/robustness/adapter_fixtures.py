"""A valid tiny adapter's files and both adapter parsers run on them, for the adapter fuzz and
mutation tests."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.errors import LoRAError
from tests.resolvers.tiny_adapter import tiny_model_config

MC = tiny_model_config()  # hidden 16, q 16, kv 8, intermediate 32, 2 layers
W, C = "adapter_model.safetensors", "adapter_config.json"
MAX_RANK = 8
GOOD_CONFIG = {
    "peft_type": "LORA",
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
}
_PARENT = {"q_proj": "self_attn", "v_proj": "self_attn", "down_proj": "mlp"}
_SHAPES = {"q_proj": (16, 16), "v_proj": (16, 8), "down_proj": (32, 16)}  # (in, out)
KEYS = [
    f"base_model.model.model.layers.{layer}.{_PARENT[m]}.{m}.lora_{ab}.weight"
    for layer in (0, 1)
    for m in _PARENT
    for ab in "AB"
]


def _good_tensors(rank: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for key in KEYS:
        d_in, d_out = _SHAPES[key.split(".")[-3]]
        shape = (rank, d_in) if ".lora_A." in key else (d_out, rank)
        out[key] = torch.randn(*shape, generator=gen) * 0.1
    return out


@functools.cache
def _valid_file() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        save_file(_good_tensors(), str(Path(tmp) / W))
        return (Path(tmp) / W).read_bytes()


def _valid() -> tuple[dict[str, Any], bytes]:
    """A fresh copy of the valid tiny adapter's (header, data)."""
    raw = _valid_file()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _pack(header: dict[str, Any] | str | bytes, data: bytes, n: int | None = None) -> bytes:
    """A safetensors file: the 8-byte length (``n``: a lie, if given), the header, the data."""
    if isinstance(header, bytes):
        raw = header
    else:
        raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    return (len(raw) if n is None else n).to_bytes(8, "little") + raw + data


def _run(config: bytes, weights: bytes) -> list[str]:
    """Write the two files, run both parsers; return what each did (error class or "ok").

    The parsers agree: preflight (header only) passes exactly the files load_adapter loads,
    except for weight values, which only load_adapter reads."""
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / C).write_bytes(config)
        (d / W).write_bytes(weights)
        for check in (
            lambda: preflight(d, MC, max_lora_rank=MAX_RANK, max_bytes=1 << 20),
            lambda: load_adapter(d, MC, max_lora_rank=MAX_RANK),
        ):
            try:
                check()
                outcomes.append("ok")
            except LoRAError as e:  # anything else fails the example
                assert str(e) and len(str(e)) < 2000, e
                outcomes.append(type(e).__name__)
    if outcomes[0] == "ok":
        assert outcomes[1] in ("ok", "AdapterValueError"), outcomes
    if outcomes[1] == "ok":
        assert outcomes[0] == "ok", outcomes
    return outcomes
