"""Property-based fuzzing of adapter files through preflight and load_adapter (the two parsers
every adapter passes before it could reach a slot): whatever the bytes, the only exceptions are
typed LoRAError subclasses (a 4xx at the admin route), never another type, never a hang.

Inputs: safetensors headers from a grammar of entries (raw JSON text, so duplicate keys too),
lying header lengths, data of any length and content; a valid tiny adapter's file with a few
random edits (reaches the shape/rank/target checks); random bytes; adapter_config.json from a
grammar of PEFT keys with hostile values and regexes over a regex alphabet; arbitrary JSON.
Examples are bounded and derandomized (the same cases every run); each example has a deadline.
Both parsers must also agree (see ``_run``). Fixed mutations of the valid adapter, each with the
error it must give, are in test_adapter_mutations.py.
"""

from __future__ import annotations

import json
import math
import struct
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.engine.adapters.peft_config import parse_peft_config_json
from loraplex.engine.errors import AdapterConfigError
from tests.robustness.adapter_fixtures import GOOD_CONFIG, KEYS, _pack, _run, _valid, _valid_file

FUZZ = settings(
    max_examples=120,
    deadline=timedelta(seconds=5),  # a hang (ReDoS, runaway loop) fails the example
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

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
