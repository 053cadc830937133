"""The real server driven by the official openai client: outputs equal HF + PEFT (greedy)."""

from __future__ import annotations

import asyncio
import random

import pytest

from loraplex.engine.tokenizer import Tokenizer
from tests.helpers.peft_oracle import compare
from tests.helpers.server import BASE

GREEDY = {"temperature": 0.0}
EXACT = {"ignore_eos": True, "return_token_ids": True}


async def test_models_lists_base_and_adapters(server, tiny):
    models = (await server.client().models.list()).data
    cards = {m.id: m for m in models}
    assert list(cards) == [BASE, *tiny.adapters]
    # where models come from is operator information: without the admin token, names only
    assert cards[BASE].root == BASE and cards[BASE].parent is None
    for name in tiny.adapters:
        assert cards[name].parent == BASE
        assert cards[name].root == name
        assert cards[name].object == "model"


async def _completion(client, prompt, model, n_tokens, stream):
    if not stream:
        r = await client.completions.create(
            model=model, prompt=prompt, max_tokens=n_tokens, extra_body=EXACT, **GREEDY
        )
        (choice,) = r.choices
        assert r.usage.completion_tokens == len(choice.token_ids) == n_tokens
        assert r.usage.prompt_tokens == len(choice.prompt_token_ids)
        return choice.prompt_token_ids, choice.token_ids, choice.finish_reason
    tokens, reason, prompt_ids = [], None, None
    s = await client.completions.create(
        model=model, prompt=prompt, max_tokens=n_tokens, stream=True, extra_body=EXACT, **GREEDY
    )
    async for chunk in s:
        (choice,) = chunk.choices
        tokens += choice.token_ids
        reason = choice.finish_reason or reason
        prompt_ids = getattr(choice, "prompt_token_ids", None) or prompt_ids
    return prompt_ids, tokens, reason


async def test_concurrent_mixed_adapters_match_hf_peft(server, tiny, hf):
    g = random.Random(5)
    models = [BASE, *tiny.adapters]
    reqs = []
    for i in range(12):
        prompt = [g.randrange(3, 250) for _ in range(g.randint(2, 24))]
        if i % 4 == 3:
            prompt = "The quick brown fox"  # a text prompt: the server tokenizes it
        reqs.append((prompt, models[i % len(models)], g.randint(3, 8), i % 2 == 1))
    client = server.client()
    results = await asyncio.gather(*(_completion(client, *r) for r in reqs))
    for (prompt, model, n, _), (prompt_ids, tokens, reason) in zip(reqs, results, strict=True):
        if isinstance(prompt, list):
            assert prompt_ids == prompt
        ref, gaps = hf.greedy(prompt_ids, None if model == BASE else model, n)
        compare(tokens, ref, gaps)
        assert reason == "length"
    assert server.engine.stats()["adapters"]["gpu_evictions"] > 0  # 3 adapters, 2 slots


async def test_chat_stream_and_not_match_hf_peft(server, tiny, hf):
    tok = Tokenizer.from_dir(tiny.model_dir)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    expected_prompt = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    ref, gaps = hf.greedy(expected_prompt, "poem", 7)
    client = server.client()
    r = await client.chat.completions.create(
        model="poem", messages=messages, max_completion_tokens=7, extra_body=EXACT, **GREEDY
    )
    (choice,) = r.choices
    assert choice.prompt_token_ids == expected_prompt
    compare(choice.token_ids, ref, gaps)
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(choice.token_ids)
    assert r.usage.prompt_tokens == len(expected_prompt) and r.usage.completion_tokens == 7

    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="poem",
            messages=messages,
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXACT,
            **GREEDY,
        )
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.total_tokens == len(expected_prompt) + 7
    body = chunks[1:-1]
    tokens = [t for c in body for t in c.choices[0].token_ids]
    assert tokens == choice.token_ids
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert body[-1].choices[0].finish_reason == "length"


async def test_n_and_several_prompts_index_choices(server):
    r = await server.client().completions.create(
        model="sql",
        prompt=[[5, 6, 7], [9, 10, 11, 12]],
        n=2,
        max_tokens=4,
        extra_body=EXACT,
        **GREEDY,
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].prompt_token_ids == [5, 6, 7]
    assert r.choices[2].prompt_token_ids == [9, 10, 11, 12]
    assert r.choices[0].token_ids == r.choices[1].token_ids  # greedy: n identical samples
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 16

    seeded = await server.client().completions.create(
        model=BASE, prompt=[5, 6, 7], n=3, max_tokens=6, temperature=1.0, seed=1234
    )
    again = await server.client().completions.create(
        model=BASE, prompt=[5, 6, 7], n=3, max_tokens=6, temperature=1.0, seed=1234
    )
    assert [c.text for c in seeded.choices] == [c.text for c in again.choices]


async def test_completion_logprobs_shape(server):
    by_id = {**EXACT, "return_tokens_as_token_ids": True}  # decoded pieces may collide
    r = await server.client().completions.create(
        model="math", prompt=[3, 4, 5, 6], max_tokens=5, logprobs=3, extra_body=by_id, **GREEDY
    )
    c = r.choices[0]
    lp = c.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in c.token_ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and top[token] == logprob  # greedy: the sampled token is in the top
        assert logprob == max(top.values())

    text = await server.client().completions.create(
        model="math", prompt=[3, 4, 5, 6], max_tokens=5, logprobs=0, **GREEDY
    )
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert lp.token_logprobs == pytest.approx(r.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert all(len(top) == 1 for top in lp.top_logprobs)


async def test_chat_logprobs_top_k(server):
    r = await server.client().chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == item.top_logprobs[0].logprob
        assert item.bytes == list(item.token.encode())


async def test_stop_string_ends_the_choice(server):
    client = server.client()
    free = await client.completions.create(
        model="sql", prompt="Hello world", max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    )
    text = free.choices[0].text
    stop = next((ch for ch in text[1:] if ch.strip() and ch != "\ufffd"), None)
    assert stop is not None, text
    cut = await client.completions.create(
        model="sql",
        prompt="Hello world",
        max_tokens=12,
        stop=[stop, "\x00never"],
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == text[: text.index(stop)]


async def test_health(server):
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"{server.url}/health") as r:
        assert r.status == 200
