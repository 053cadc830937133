"""Property-based fuzzing of adapter files through preflight and load_adapter (the two parsers
every adapter passes before it could reach a slot): whatever the bytes, the only exceptions are
typed LoRAError subclasses (a 4xx at the admin route), never another type, never a hang.

Inputs: safetensors headers from a grammar of entries (raw JSON text, so duplicate keys too),
lying header lengths, data of any length and content; a valid tiny adapter's file with a few
random edits (reaches the shape/rank/target checks); random bytes; adapter_config.json from a
grammar of PEFT keys with hostile values and regexes over a regex alphabet; arbitrary JSON.
Then fixed mutations of the valid adapter, each with the error it must give. Examples are
bounded and derandomized (the same cases every run); each example has a deadline. Both parsers
must also agree (see ``_run``).
"""

from __future__ import annotations

import functools
import json
import math
import struct
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from loraplex.engine.lora import errors
from loraplex.engine.lora.adapter import load_adapter
from loraplex.engine.lora.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterShapeError,
    AdapterValueError,
    LoRAError,
)
from loraplex.engine.lora.peft_config import parse_peft_config_json
from loraplex.engine.lora.preflight import preflight
from tests.resolvers.tiny_adapter import tiny_model_config

MC = tiny_model_config()  # hidden 16, q 16, kv 8, intermediate 32, 2 layers
W, C = "adapter_model.safetensors", "adapter_config.json"
MAX_RANK = 8
FUZZ = settings(
    max_examples=120,
    deadline=timedelta(seconds=5),  # a hang (ReDoS, runaway loop) fails the example
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
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


# -- safetensors ------------------------------------------------------------------------------

_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_key = st.one_of(
    st.sampled_from(
        [
            *KEYS,
            "__metadata__",
            "lm_head.weight",
            "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
            "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight",
            "base_model.model.model.layers.0.mlp.q_proj.lora_B.weight",
            "lora_A.weight",
            "",
        ]
    ),
    st.text(max_size=24),
)
_dim = st.one_of(
    st.sampled_from([0, 1, 2, 8, 16, 32]),
    st.integers(-3, 2**66),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
)
_entry_dtype = st.one_of(
    st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "f32"]),
    _json_scalar,
)
_entry = st.one_of(
    st.fixed_dictionaries(
        {
            "dtype": _entry_dtype,
            "shape": st.one_of(st.lists(_dim, max_size=3), _json),
            "data_offsets": st.one_of(
                st.lists(st.integers(-2, 2**65), min_size=2, max_size=2),
                st.lists(st.sampled_from([0, 64, 128, 256, 512, 1024]), min_size=2, max_size=2),
                _json,
            ),
        }
    ),
    _json,
)


@st.composite
def _safetensors(draw: st.DrawFn) -> bytes:
    entries = draw(st.lists(st.tuples(_key, _entry), max_size=8))
    # raw JSON text, so duplicate keys reach the parsers too
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entries) + "}"
    if draw(st.booleans()):
        text = draw(st.sampled_from(["", "[]", "null", '{"a": ', text[: len(text) // 2]]))
    header = text.encode()
    n = draw(
        st.one_of(
            st.just(len(header)),
            st.integers(0, len(header) + 64),
            st.sampled_from([2**63 - 1, 2**64 - 1, 100 << 20, 8 << 20]),
        )
    )
    data_len = draw(st.one_of(st.sampled_from([0, 64, 128, 256, 512, 1024]), st.integers(0, 2048)))
    if data_len <= 256 and draw(st.booleans()):
        data = draw(st.binary(min_size=data_len, max_size=data_len))
    else:
        data = _pattern(draw, data_len)
    return n.to_bytes(8, "little") + header + data


def _pattern(draw: st.DrawFn, size: int) -> bytes:
    """Data bytes: zeros, ordinary floats, or NaN/Inf/huge float32 patterns."""
    value = draw(st.sampled_from([0.0, 0.25, -1.5, math.nan, math.inf, 3e38, 1e5]))
    return (struct.pack("<f", value) * (size // 4 + 1))[:size]


@FUZZ
@given(weights=_safetensors())
def test_fuzzed_safetensors_give_only_typed_errors(weights: bytes) -> None:
    _run(json.dumps(GOOD_CONFIG).encode(), weights)


def _plain_entry(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and isinstance(v.get("shape"), list)
        and isinstance(v.get("data_offsets"), list)
        and len(v["data_offsets"]) == 2
        and all(isinstance(o, int) for o in v["data_offsets"])
    )


@st.composite
def _near_valid_safetensors(draw: st.DrawFn) -> bytes:
    """A valid tiny adapter's file with a few random edits: reaches the deeper checks."""
    header, data = _valid()
    for _ in range(draw(st.integers(1, 3))):
        if not header:
            break
        key = draw(st.sampled_from(sorted(header)))
        what = draw(st.sampled_from(["dtype", "shape", "offsets", "rename", "drop", "entry"]))
        if what in ("dtype", "shape", "offsets") and not _plain_entry(header[key]):
            what = "entry"  # an earlier edit replaced it
        if what == "dtype":
            header[key]["dtype"] = draw(_entry_dtype)
        elif what == "shape":
            shape = header[key]["shape"]
            header[key]["shape"] = draw(
                st.one_of(st.permutations(shape), st.lists(_dim, max_size=3), _json)
            )
        elif what == "offsets":
            b, e = header[key]["data_offsets"]
            header[key]["data_offsets"] = [
                b + draw(st.integers(-8, 8)),
                e + draw(st.sampled_from([-8, -4, 0, 0, 4, 8, 2**64])),
            ]
        elif what == "rename":
            header[draw(_key)] = header.pop(key)
        elif what == "drop":
            del header[key]
        else:
            header[key] = draw(_entry)
    cut = draw(st.sampled_from([0, 0, 0, 4, 64, -4]))
    data = data[: len(data) - cut] if cut >= 0 else data + b"\0" * -cut
    if draw(st.booleans()):  # garbage values in a slice
        at = draw(st.integers(0, max(0, len(data) - 16)))
        data = data[:at] + _pattern(draw, 16) + data[at + 16 :]
    return _pack(header, data, None if draw(st.booleans()) else draw(st.integers(0, 2048)))


@FUZZ
@given(weights=_near_valid_safetensors())
def test_near_valid_safetensors_give_only_typed_errors(weights: bytes) -> None:
    _run(json.dumps(GOOD_CONFIG).encode(), weights)


@FUZZ
@given(weights=st.binary(max_size=600))
def test_random_bytes_as_weights_give_only_typed_errors(weights: bytes) -> None:
    assert _run(json.dumps(GOOD_CONFIG).encode(), weights) != ["ok", "ok"]


# -- adapter_config.json ----------------------------------------------------------------------

_regex = st.text(alphabet="().*+?|[]{}^$\\dqz_,0123456789-", max_size=24)
_targets = st.one_of(
    st.lists(st.sampled_from(["q_proj", "v_proj", "down_proj"]), min_size=3, unique=True),
    st.lists(st.sampled_from(["q_proj", "v_proj", "down_proj", "k_proj", "lm_head", ""])),
    _regex,
    st.sampled_from([r".*\.(q_proj|v_proj|down_proj)", "all-linear", "(.*){8}z", ".*"]),
    _json,
)
_config = st.fixed_dictionaries(
    {"peft_type": st.one_of(st.just("LORA"), st.just("LORA"), _json)},
    optional={
        "r": st.one_of(st.just(2), st.sampled_from([4, 0, -1, 2**40]), _json),
        "lora_alpha": st.one_of(st.just(4), st.sampled_from([0.5, 1e300, -4, 1e38]), _json),
        "target_modules": _targets,
        "exclude_modules": st.one_of(st.none(), _targets),
        "rank_pattern": st.one_of(
            st.dictionaries(_regex, st.sampled_from([2, 2, 3, 0, -1]), max_size=3), _json
        ),
        "alpha_pattern": st.one_of(st.dictionaries(_regex, st.floats(), max_size=3), _json),
        "layers_to_transform": st.one_of(st.lists(st.integers(-1, 3), max_size=3), _json),
        "layers_pattern": st.one_of(st.none(), _regex, st.lists(_regex, max_size=2)),
        "use_rslora": st.one_of(st.booleans(), _json),
        "bias": st.one_of(st.just("none"), _json),
        "use_dora": st.one_of(st.just(False), _json),
        "modules_to_save": st.one_of(st.none(), _json),
    },
)


@FUZZ
@given(config=_config)
def test_fuzzed_configs_give_only_typed_errors(config: dict[str, Any]) -> None:
    raw = {**GOOD_CONFIG, **config} if config.get("peft_type") == "LORA" else config
    _run(json.dumps(raw).encode(), _valid_file())


@FUZZ
@given(
    text=st.one_of(
        st.binary(max_size=200),
        _json.map(lambda v: json.dumps(v).encode()),
        st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 5000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    )
)
def test_config_parser_gives_only_typed_errors(text: bytes) -> None:
    with pytest.raises(AdapterConfigError):
        parse_peft_config_json(text)


# -- mutations of a valid tiny adapter --------------------------------------------------------


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
