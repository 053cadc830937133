"""Start-up refusals of speculative decoding: typed (SpeculativeConfigError, a ValueError),
naming the EngineConfig field; and the KV rollback of the block manager (``truncate``)."""

from __future__ import annotations

import pytest

from loraplex.engine import AsyncEngine, EngineConfig
from loraplex.engine.errors import SpeculativeConfigError
from loraplex.engine.kv import BlockManager
from tests.helpers.engine import config


@pytest.mark.parametrize(
    ("kw", "field", "words"),
    [
        (dict(speculative_method="ngram", tensor_parallel_size=2), "speculative_method",
         "tensor_parallel_size"),
        (dict(speculative_method="ngram", quantization="fp8"), "speculative_method", "fp8"),
        (dict(speculative_method="draft"), "speculative_model", "--speculative-model"),
        (dict(speculative_method="eagle"), "speculative_method", "ngram, draft"),
        (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens",
         "1..16"),
        (dict(num_speculative_tokens=17), "num_speculative_tokens", "1..16"),
        (dict(speculative_method="ngram", speculative_max_running=0), "speculative_max_running",
         ">= 1"),
    ],
)  # fmt: skip
def test_config_refuses(kw, field, words):
    with pytest.raises(SpeculativeConfigError, match=words) as e:
        EngineConfig(**kw)
    assert e.value.field == field
    assert isinstance(e.value, ValueError)


def test_defaults_are_off():
    cfg = EngineConfig()
    assert cfg.speculative_method is None and cfg.num_speculative_tokens == 4
    assert cfg.speculative_model is None


async def test_draft_refused_at_start_up_while_not_built(tiny, tmp_path):
    model_dir, _ = tiny
    cfg = config(model_dir, speculative_method="draft", speculative_model=str(tmp_path))
    with pytest.raises(SpeculativeConfigError, match="draft.py") as e:
        async with AsyncEngine(cfg):
            pass
    assert e.value.field == "speculative_method"


async def test_fp8_checkpoint_refused_at_start_up(tiny, monkeypatch):
    # a checkpoint whose projections load as fp8 (quantization None): seen on the model
    import loraplex.engine.startup as startup

    model_dir, _ = tiny
    monkeypatch.setattr(startup, "fp8_layers", lambda model: [object()])
    with pytest.raises(SpeculativeConfigError, match="fp8"):
        async with AsyncEngine(config(model_dir, speculative_method="ngram")):
            pass


def test_truncate_frees_the_tail_and_keeps_cached_blocks():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(6)), None)  # 2 blocks
    bm.append("a", 6 + 5)  # a verification row: 3 blocks for 11 tokens
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    bm.mark_computed("a", list(range(8)), 8)  # first two blocks full, kept: cached
    bm.truncate("a", 9)
    assert len(bm.block_table("a")) == 3  # 9 tokens still need 3 blocks
    bm.truncate("a", 8)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6
    assert bm.num_cached_blocks == 2
    with pytest.raises(ValueError, match="cached"):
        bm.truncate("a", 4)
    bm.append("a", 9)  # grows again on the next step
    assert len(bm.block_table("a")) == 3
    bm.free("a")
    assert bm.num_free_blocks == 8
