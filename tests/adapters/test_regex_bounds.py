"""Regexes from adapter_config.json are untrusted: Python's backtracking ``re`` would run a
hostile one for seconds to minutes in one C call holding the GIL (``(.*){8}z``: ~24 s per
module name). Patterns whose worst-case work is unbounded are refused with a typed
AdapterConfigError at parse time; ordinary PEFT patterns keep ``re.fullmatch`` semantics."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from loraplex.engine.adapters.parse import base_module_name, load_adapter
from loraplex.engine.adapters.peft_config import (
    MAX_MODULE_NAME_CHARS,
    MAX_REGEX_STEPS,
    parse_peft_config,
    regex_work,
)
from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.errors import AdapterConfigError
from loraplex.engine.model.config import LORA_MODULES
from tests.resolvers.tiny_adapter import tiny_model_config, write_adapter

BASE = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
HOSTILE = [
    r"(.*){8}z",  # the reported one: ~24 s per name
    r"(x+)+y",
    r"(.|.)*z",
    r"(?:a|ab)*c",
    r"(.*a){12}",
    r".*.*.*.*.*.*.*z",
    r"(?:(?:){1000}){1000}",  # empty iterations still cost: 1e6 steps
    r"(?:x?){10000000}",
]
# where a regex can hide in adapter_config.json, as (field named in the error, config)
PLACES: dict[str, Any] = {
    "target_modules": lambda p: {"target_modules": p},
    "exclude_modules": lambda p: {"exclude_modules": p},
    "rank_pattern": lambda p: {"rank_pattern": {p: 2}},
    "alpha_pattern": lambda p: {"alpha_pattern": {p: 2.0}},
    "layers_pattern": lambda p: {"layers_pattern": p, "layers_to_transform": [0]},
}
NAMES = [base_module_name(i, m) for i in range(12) for m in LORA_MODULES]
NAMES += ["lm_head", "model.embed_tokens", "model.layers.0.self_attn"]


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("pattern", HOSTILE)
def test_hostile_patterns_are_refused_at_parse(pattern: str, place: str) -> None:
    with pytest.raises(AdapterConfigError, match="backtracking steps") as ei:
        parse_peft_config({**BASE, **PLACES[place](pattern)})
    assert ei.value.field is not None and ei.value.field.startswith(place)


def _bounded(fn: Any, *args: Any, **kw: Any) -> Any:
    """Run ``fn`` in a worker thread; a hang fails the test instead of blocking the suite."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args, **kw).result(timeout=30)
    finally:
        pool.shutdown(wait=False)  # NOTE: a hung match cannot be stopped; do not wait for it


@pytest.mark.parametrize("check", ["preflight", "load_adapter"])
def test_hostile_target_regex_fails_fast_through_the_loaders(tmp_path: Path, check: str) -> None:
    folder = write_adapter(tmp_path / "a", config={"target_modules": r"(.*){8}z"})
    mc = tiny_model_config()
    with pytest.raises(AdapterConfigError, match="target_modules"):
        if check == "preflight":
            _bounded(preflight, folder, mc, max_lora_rank=16, max_bytes=None)
        else:
            _bounded(load_adapter, folder, mc, max_lora_rank=16)


ORDINARY = [
    r".*\.(q_proj|v_proj)",
    r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj",
    r".*layers\.1\..*_proj",
    r".*language_model.*\.(q_proj|v_proj)",
    r"^(?!.*\.mlp\.).*\.(q_proj|k_proj|v_proj|o_proj)",
    r".*\.layers\.(0|1|2|3|4|5|6|7|8|9|10|11)\..*(q_proj|v_proj)",
    r"(?i).*\.(Q_PROJ|down_proj)",
    r"model\.layers\.[0-5]\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
    r".*",
]


@pytest.mark.parametrize("pattern", ORDINARY)
def test_ordinary_patterns_keep_fullmatch_semantics(pattern: str) -> None:
    assert regex_work(pattern, MAX_MODULE_NAME_CHARS) <= MAX_REGEX_STEPS
    as_target = parse_peft_config({**BASE, "target_modules": pattern})
    as_exclude = parse_peft_config(
        {**BASE, "target_modules": list(LORA_MODULES), "exclude_modules": pattern}
    )
    for name in NAMES:
        hit = re.fullmatch(pattern, name) is not None
        assert as_target.targets(name) == hit, name
        if name.endswith(LORA_MODULES):
            assert as_exclude.targets(name) == (not hit), name


def test_pattern_keys_keep_peft_semantics() -> None:
    keys = {r"layers\.\d\.self_attn\.k_proj": 7, r".*_proj": 9, "q_proj": 5}
    cfg = parse_peft_config({**BASE, "rank_pattern": keys})
    for name in NAMES:
        key = next((k for k in keys if re.match(rf"(.*\.)?({k})$", name)), None)
        assert cfg.rank_for(name) == (4 if key is None else keys[key]), name


@pytest.mark.parametrize(
    ("pattern", "match"),
    [
        ("(" * 400 + "a" + ")" * 400, "'\\('"),  # re.compile recursed past the limit (500 deep)
        ("(" * 600 + "a" + ")" * 600, "'\\('"),
        ("a" * 5000, "characters"),
        (r"(a)\1", "not a valid or supported regex"),  # backreference
        (r"(?P<x>a)(?(x)b|c)", "not a valid or supported regex"),
        ("(unclosed", "not a valid or supported regex"),
    ],
)
def test_unsupported_or_oversized_patterns(pattern: str, match: str) -> None:
    with pytest.raises(AdapterConfigError, match=match):
        parse_peft_config({**BASE, "target_modules": pattern})


def test_work_bound_grows_with_nesting_not_with_ordinary_length() -> None:
    n = MAX_MODULE_NAME_CHARS
    assert regex_work(".*", n) <= 2 * (n + 2)
    assert (
        regex_work(".*" * 2 + "z", n)
        < regex_work(".*" * 3 + "z", n)
        < regex_work(".*" * 4 + "z", n)
    )
    long_literal = re.escape(".".join(["model", "layers", "0", "self_attn", "q_proj"]) * 20)
    assert regex_work(long_literal, n) <= len(long_literal) + 1
    # alternatives that start with distinct literals cannot all proceed
    assert regex_work(".*(q_proj|k_proj|v_proj|o_proj)", n) < 2 * regex_work(".*q_proj", n)
    # ... unless case is ignored
    assert regex_work("(?i)(a.*|A.*)+", n) > MAX_REGEX_STEPS


def test_names_longer_than_the_bound_are_refused() -> None:
    cfg = parse_peft_config({**BASE, "target_modules": r".*q_proj"})
    with pytest.raises(AdapterConfigError, match="longer than"):
        cfg.targets("x" * (MAX_MODULE_NAME_CHARS + 1))


def test_error_message_is_short_and_json_safe() -> None:
    pattern = "(.*)" * 50 + "z"
    with pytest.raises(AdapterConfigError) as ei:
        parse_peft_config({**BASE, "target_modules": pattern})
    assert len(str(ei.value)) < 600
    json.dumps({"message": str(ei.value)})


def test_odd_but_bounded_patterns_log_no_python_warnings() -> None:
    """A nested-set look-alike (``[[``) compiles with a FutureWarning from Python's parser:
    the adapter's pattern is data, admitted or refused without warnings on the log."""
    import warnings

    cfg = dict(BASE, target_modules=r".*[[a-z]_proj")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parsed = parse_peft_config(cfg)
        assert parsed.targets("model.layers.0.self_attn.q_proj")
