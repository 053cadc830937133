"""Start-up refusals of speculative decoding: typed (SpeculativeConfigError, a ValueError),
naming the EngineConfig field; the draft adapters' config field; one KV budget split between
the target's and the draft's caches; and the KV rollback of the block manager (``truncate``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

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


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(speculative_method="ngram", speculative_draft_adapters={"a": "/x"}), "'draft'"),
        (dict(speculative_draft_adapters=(("a", "/x"), ("a", "/y"))), "twice"),
        (dict(speculative_draft_adapters={"": "/x"}), "name -> draft adapter folder"),
        (dict(speculative_draft_adapters=[("a", None)]), "name -> draft adapter folder"),
        (dict(speculative_draft_adapters=["a=/x"]), "name -> draft adapter folder"),
    ],
)
def test_draft_adapters_refused(kw, words):
    kw = {"speculative_method": "draft", "speculative_model": "/m", **kw}
    with pytest.raises(SpeculativeConfigError, match=words) as e:
        EngineConfig(**kw)
    assert e.value.field == "speculative_draft_adapters"


def test_draft_adapters_are_sorted_pairs_from_a_mapping_or_pairs():
    kw = dict(speculative_method="draft", speculative_model="/m")
    a = EngineConfig(**kw, speculative_draft_adapters={"b": Path("/y"), "a": "/x"})
    b = EngineConfig(**kw, speculative_draft_adapters=[("a", "/x"), ("b", "/y")])
    assert a == b and hash(a) == hash(b)
    assert a.speculative_draft_adapters == (("a", "/x"), ("b", "/y"))
    assert a.draft_adapters == {"a": "/x", "b": "/y"}
    assert replace(a, seed=3).draft_adapters == a.draft_adapters


async def test_one_kv_budget_holds_the_target_and_the_draft(tiny):
    """kv_cache_bytes (as the free GPU memory) sizes both caches: n target blocks and the
    draft's blocks for them fit the budget, and n + 1 would not."""
    from loraplex.engine.model_runner import ModelRunner
    from loraplex.engine.spec.draft import draft_kv_bytes_per_block
    from loraplex.engine.spec.draft_start import draft_blocks_for

    model_dir, _ = tiny
    budget = 1 << 20
    cfg = config(model_dir, kv_cache_bytes=budget, speculative_method="draft",
                 speculative_model=str(model_dir))  # fmt: skip
    async with AsyncEngine(cfg) as engine:
        n = engine.stats()["num_blocks"]
        draft = engine.testing.scheduler.spec.proposer
        per = ModelRunner.kv_bytes_per_block(engine.testing.executor.model, cfg.block_size)
        per_draft = draft_kv_bytes_per_block(draft.config, draft.model.dtype, cfg.block_size)
        assert draft.blocks.num_blocks == draft_blocks_for(cfg, n) > n
        assert n * per + draft.blocks.num_blocks * per_draft <= budget
        assert (n + 1) * per + draft_blocks_for(cfg, n + 1) * per_draft > budget
    async with AsyncEngine(config(model_dir, kv_cache_bytes=budget)) as engine:
        assert engine.stats()["num_blocks"] == budget // per > n
    fixed = config(model_dir, num_kv_blocks=40, speculative_method="draft",
                   speculative_model=str(model_dir))  # fmt: skip
    async with AsyncEngine(fixed) as engine:  # num_kv_blocks: the target's, the draft's follow
        assert engine.stats()["num_blocks"] == 40
        assert engine.testing.scheduler.spec.proposer.blocks.num_blocks == draft_blocks_for(
            fixed, 40
        )


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
