"""``loraplex serve`` flags of speculative decoding and the request body's opt-out."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.engine.errors import SpeculativeConfigError
from loraplex.engine.sampling_params import InvalidSamplingParams
from loraplex.engine.server.cli import build_parser
from loraplex.engine.server.errors import APIError
from loraplex.engine.server.launch import config_from_args
from loraplex.engine.server.protocol import parse_completion


def test_flags_map_onto_engine_config(tmp_path):
    off = config_from_args(build_parser().parse_args(["serve"]))
    assert off.speculative_method is None
    args = build_parser().parse_args(
        ["serve", "--speculative-method", "ngram", "--num-speculative-tokens", "6",
         "--speculative-max-running", "4"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.speculative_method, cfg.num_speculative_tokens) == ("ngram", 6)
    assert cfg.speculative_max_running == 4
    args = ["serve", "--speculative-method", "draft", "--speculative-model", str(tmp_path)]
    cfg = config_from_args(build_parser().parse_args(args))
    assert cfg.speculative_model == str(tmp_path)
    with pytest.raises(SpeculativeConfigError, match="--speculative-model"):
        config_from_args(build_parser().parse_args(args[:3]))
    with pytest.raises(SpeculativeConfigError, match="1..16"):
        config_from_args(
            build_parser().parse_args(["serve", "--speculative-method", "ngram",
                                       "--num-speculative-tokens", "40"])
        )  # fmt: skip
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-method", "eagle"])


def test_draft_adapter_flag_is_repeatable(tmp_path, capsys):
    base = ["serve", "--speculative-method", "draft", "--speculative-model", str(tmp_path)]
    args = base + ["--speculative-draft-adapter", "sql=/d/sql",
                   "--speculative-draft-adapter", "chat=~/d/chat"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(args))
    home = str(Path("~").expanduser())
    assert cfg.draft_adapters == {"sql": "/d/sql", "chat": f"{home}/d/chat"}
    assert config_from_args(build_parser().parse_args(base)).speculative_draft_adapters == ()
    for bad in ("sql", "=/d", "sql="):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, "--speculative-draft-adapter", bad])
        assert "NAME=DIR" in capsys.readouterr().err
    ngram = ["serve", "--speculative-method", "ngram", "--speculative-draft-adapter", "a=/d"]
    with pytest.raises(SpeculativeConfigError, match="--speculative-draft-adapter"):
        config_from_args(build_parser().parse_args(ngram))


def test_request_opt_out_field():
    req = parse_completion({"prompt": "hi", "max_tokens": 3, "speculative": False})
    assert req.params(2, 100).speculative is False
    assert parse_completion({"prompt": "hi", "max_tokens": 3}).params(2, 100).speculative
    bad = parse_completion({"prompt": "hi", "max_tokens": 3, "speculative": "no"})
    with pytest.raises(InvalidSamplingParams) as e:
        bad.params(2, 100)
    assert e.value.field == "speculative"
    assert isinstance(e.value, ValueError) and not isinstance(e.value, APIError)
