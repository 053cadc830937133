"""``"adapters": [{"name": ..., "weight": ...}]`` through the official client's ``extra_body``:
completions and chat on a composition equal PEFT's ``add_weighted_adapter(..., "cat")``;
bad compositions are 400s that load nothing."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.peft_oracle import HFReference, compare
from tests.helpers.server import BASE

COMBO = [{"name": "sql", "weight": 0.8}, {"name": "math", "weight": 0.5}]
EXACT = {"ignore_eos": True, "return_token_ids": True}


async def test_composition_over_http_matches_peft_cat(server, tiny):
    client = server.client()
    prompt = [5, 17, 99, 3, 42, 8]
    r = await client.completions.create(
        model=BASE, prompt=prompt, max_tokens=6, temperature=0.0,
        extra_body={**EXACT, "adapters": COMBO},
    )  # fmt: skip
    (choice,) = r.choices
    assert r.model == BASE
    chat = await client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0,
        stream=True, extra_body={"adapters": COMBO},
    )  # fmt: skip
    assert [c async for c in chat]
    hf = HFReference(tiny.model_dir, {k: tiny.adapters[k] for k in ("sql", "math")})
    hf.model.add_weighted_adapter(["sql", "math"], [0.8, 0.5], "combo", combination_type="cat")
    ref, gaps = hf.greedy(prompt, "combo", 6)
    compare(choice.token_ids, ref, gaps)
    plain, _ = hf.greedy(prompt, "sql", 6)
    assert ref != plain


@pytest.mark.parametrize(
    ("model", "adapters", "param", "match"),
    [
        (BASE, [{"name": "sql", "weight": 1}, {"name": "nope", "weight": 1}], "adapters", "nope"),
        (
            BASE,
            [
                {"name": "sql", "weight": 1},
                {"name": "poem", "weight": 1},
                {"name": "math", "weight": 1},
            ],
            "adapters",
            "above max_lora_rank",
        ),
        ("sql", [{"name": "math", "weight": 1}], "model", "base model"),
        (BASE, [{"name": "sql", "weight": "1"}], "adapters[0].weight", "number"),
        (BASE, [], "adapters", "non-empty"),
        (BASE, [{"name": "sql", "weight": 1, "path": "/x"}], "adapters[0]", "name"),
    ],
)
async def test_bad_compositions_are_400s_and_load_nothing(server, model, adapters, param, match):
    client = server.client()
    before = server.engine.stats()
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(
            model=model, prompt=[1, 2], max_tokens=2, extra_body={"adapters": adapters}
        )
    err = info.value.body
    assert err["param"] == param and match in err["message"], err
    after = server.engine.stats()
    assert after["adapter_refs"].keys() == before["adapter_refs"].keys()
    assert after["adapters"]["loads"] == before["adapters"]["loads"]
