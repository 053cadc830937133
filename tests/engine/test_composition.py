"""Per-request composition through AsyncEngine: ``adapter=[("sql", 0.7), ("math", 0.3)]``
against PEFT's ``add_weighted_adapter(..., combination_type="cat")``, mixed with plain
adapter rows and base rows; its cache identity; refusals that leave nothing loaded."""

from __future__ import annotations

import asyncio
import random

import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import AdapterCompositionError
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.peft_oracle import HFReference, compare

COMBO = [("sql", 0.7), ("math", -0.4)]  # ranks 4 + 6, sql on q/v, math on gate/up/q
COMBO_NAME = "sql*0.7+math*-0.4"


def reference(model_dir, adapters) -> HFReference:
    hf = HFReference(model_dir, {k: adapters[k] for k in ("sql", "math", "poem")})
    hf.model.add_weighted_adapter(
        [n for n, _ in COMBO], [w for _, w in COMBO], "combo", combination_type="cat"
    )
    return hf


async def test_composition_matches_peft_cat_in_a_mixed_batch(tiny):
    model_dir, adapters = tiny
    g = random.Random(21)
    choices = [None, "poem", "sql", COMBO, COMBO]
    reqs = []
    for i in range(10):
        prompt = [g.randrange(3, 250) for _ in range(g.randint(2, 20))]
        reqs.append((f"r{i}", prompt, choices[i % len(choices)], g.randint(3, 6)))
    async with AsyncEngine(config(model_dir, max_loras=3)) as engine:
        await register(engine, {k: adapters[k] for k in ("sql", "math", "poem")})
        results = await asyncio.gather(
            *(
                collect(
                    engine,
                    p,
                    SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                    a,
                    rid,
                )
                for rid, p, a, n in reqs
            )
        )
        s = engine.stats()
        assert_idle(engine)
    # the combination only: add_adapter's pass made poem's and sql's images (math is read only
    # into the combination, from its staged copy)
    assert s["adapters"]["loads"] == 1, s["adapters"]
    assert COMBO_NAME in s["cpu_resident"]
    hf = reference(model_dir, adapters)
    for (_, prompt, a, n), (tokens, _, _) in zip(reqs, results, strict=True):
        name = "combo" if isinstance(a, list) else a
        ref, gaps = hf.greedy(prompt, name, n)
        compare(tokens, ref, gaps)
    # the combination is not its first component
    combo_tokens = [r[0] for r, q in zip(results, reqs, strict=True) if q[2] is COMBO]
    sql_alone = [hf.greedy(q[1], "sql", q[3])[0] for q in reqs if q[2] is COMBO]
    assert combo_tokens != sql_alone


async def test_composition_is_cached_with_its_own_prefix_identity(tiny):
    model_dir, adapters = tiny
    prompt = list(range(10, 40))  # 7 full blocks of 4
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, {k: adapters[k] for k in ("sql", "math")})

        async def hits(adapter):
            before = engine.stats()["prefix_cache_hits"]
            await collect(engine, prompt, params, adapter)
            return engine.stats()["prefix_cache_hits"] - before

        assert await hits(COMBO) == 0
        loads = engine.stats()["adapters"]["loads"]
        assert await hits(COMBO) > 0
        assert await hits([("sql", 0.7), ("math", -0.4)]) > 0  # same identity
        assert engine.stats()["adapters"]["loads"] == loads  # cached, not combined again
        assert await hits("sql") == 0
        assert await hits([("sql", 0.5), ("math", -0.4)]) == 0  # other weights
        assert await hits([("math", -0.4), ("sql", 0.7)]) == 0  # other order: other slot
        # a new version of a component makes a new combination
        from tests.helpers.models import make_peft_adapter

        new = make_peft_adapter(model_dir, adapters["sql"].parent / "sql-v2", r=4, alpha=8, seed=5)
        await engine.add_adapter("sql", f"file://{new}")
        assert await hits(COMBO) == 0
        assert await hits(COMBO) > 0
        assert_idle(engine)
        names = [k.split("@")[0] for k in engine.stats()["adapter_refs"]]
        assert names.count(COMBO_NAME) == 1  # the old combination was dropped


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        ([("sql", 1.0), ("nope", 1.0)], "'nope' in the composition does not exist"),
        ([("sql", 1.0), ("chat", 1.0)], r"rank 4 \(sql\) \+ 16 \(chat\) = 20 is above"),
        ([("sql", 1.0), ("sql", 0.5)], "appears twice"),
        ([("sql", float("nan"))], "finite"),
        ([("sql", "x")], "number"),
        ([], "non-empty"),
        ([("sql",)], "pair"),
    ],
)
async def test_bad_compositions_are_refused_leaving_nothing_loaded(tiny, parts, match):
    model_dir, adapters = tiny
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, {k: adapters[k] for k in ("sql", "chat")})
        before = engine.stats()
        with pytest.raises(AdapterCompositionError, match=match):
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=2), parts)
        after = engine.stats()
        assert after["adapter_refs"].keys() == before["adapter_refs"].keys()
        # (add_adapter's pass made both images: nothing loads, nothing else joins the tier)
        assert after["cpu_resident"] == before["cpu_resident"] == ["sql", "chat"]
        assert after["adapters"]["loads"] == 0
        tokens, _, _ = await collect(engine, [1, 2, 3], SamplingParams(max_tokens=2), "sql")
        assert len(tokens) == 2  # still serving
        assert_idle(engine)
