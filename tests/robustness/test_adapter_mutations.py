"""Fixed mutations of a valid tiny adapter's safetensors file through preflight and
load_adapter: each one (truncated or padded data, lying header lengths, bad offsets, dtypes and
shapes, duplicate keys, a header that is not a UTF-8 object, NaN or 3e38 values) is refused with
the typed LoRAError subclass named for it, by preflight where it reads the header and by
load_adapter always; garbage values pass preflight (it reads no data) and only load_adapter
refuses them. The unmutated file, as written and as re-packed, loads through both.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest

from loraplex.engine import errors
from loraplex.engine.errors import (
    AdapterFormatError,
    AdapterShapeError,
    AdapterValueError,
    LoRAError,
)
from tests.robustness.adapter_fixtures import GOOD_CONFIG, _pack, _run, _valid, _valid_file


def _first(header: dict[str, Any]) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _set(header: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    h = json.loads(json.dumps(header))
    h[_first(h)][field] = value
    return h


F, S, V = AdapterFormatError, AdapterShapeError, AdapterValueError


def _mutations() -> dict[str, tuple[bytes, type[LoRAError] | None, type[LoRAError]]]:
    """name -> (weights file, what preflight raises (None: passes), what load_adapter raises)."""
    header, data = _valid()
    text = json.dumps(header)
    key = _first(header)
    dup = text[:-1] + ", " + json.dumps(key) + ": " + json.dumps(header[key]) + "}"
    size, end = len(data), header[key]["data_offsets"][1]
    nan = struct.pack("<f", math.nan)
    return {
        "truncated": (_pack(header, data[:-10]), F, F),
        "trailing bytes": (_pack(header, data + b"\0" * 8), F, LoRAError),
        "header length short": (_pack(header, data, len(text) - 5), F, F),
        "header length long": (_pack(header, data, len(text) + 5), F, F),
        "header length huge": (_pack(header, data, 2**63), F, F),
        "header length past file": (_pack(header, data, len(text) + size + 1), F, F),
        "empty file": (b"", F, F),
        "only length": (_pack("", b"", 0)[:8], F, F),
        "overlapping offsets": (_pack(_set(header, "data_offsets", [4, end]), data), F, F),
        "offsets past data": (_pack(_set(header, "data_offsets", [0, size + 64]), data), F, F),
        "reversed offsets": (_pack(_set(header, "data_offsets", [64, 0]), data), F, F),
        "negative offset": (_pack(_set(header, "data_offsets", [-4, 60]), data), F, F),
        "dtype F64": (_pack(_set(header, "dtype", "F64"), data), LoRAError, LoRAError),
        "dtype lower-case": (_pack(_set(header, "dtype", "f32"), data), LoRAError, LoRAError),
        "dtype not a string": (_pack(_set(header, "dtype", 7), data), LoRAError, LoRAError),
        "shape does not fit data": (_pack(_set(header, "shape", [2, 15]), data), F, LoRAError),
        "shape transposed": (
            _pack(_set(header, "shape", header[key]["shape"][::-1]), data),
            LoRAError,  # rank 16 above the limit, or the shape
            S,
        ),
        "shape huge": (_pack(_set(header, "shape", [2**40, 2**40]), data), F, LoRAError),
        "shape negative": (_pack(_set(header, "shape", [-2, -16]), data), F, LoRAError),
        "shape 1-D": (_pack(_set(header, "shape", [32]), data), F, LoRAError),
        "duplicate key": (_pack(dup, data), F, F),
        "header not an object": (_pack("[1, 2]", data), F, F),
        "header not utf-8": (_pack(b"\xff\xfe", data), F, F),
        "metadata not strings": (_pack({**header, "__metadata__": {"a": 1}}, data), F, LoRAError),
        "nan in data": (_pack(header, nan * (size // 4)), None, V),
        "3e38 in data": (_pack(header, struct.pack("<f", 3e38) * (size // 4)), None, V),
    }


MUTATIONS = _mutations()


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_adapter_is_refused_with_a_typed_error(name: str) -> None:
    weights, at_preflight, at_load = MUTATIONS[name]
    got = _run(json.dumps(GOOD_CONFIG).encode(), weights)
    want_preflight = "ok" if at_preflight is None else at_preflight
    for outcome, want in ((got[0], want_preflight), (got[1], at_load)):
        if want == "ok":
            assert outcome == "ok", (name, got)
        else:
            assert outcome != "ok" and issubclass(getattr(errors, outcome), want), (name, got)


def test_unmutated_adapter_loads() -> None:
    """The baseline the mutations and the fuzzers start from is valid for both parsers."""
    config = json.dumps(GOOD_CONFIG).encode()
    assert _run(config, _valid_file()) == ["ok", "ok"]
    assert _run(config, _pack(*_valid())) == ["ok", "ok"]  # as re-packed by the mutations
