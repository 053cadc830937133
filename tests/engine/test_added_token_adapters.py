"""Adapters that added tokens (``lora_extra_vocab_size``, adapters/added_tokens.py) through
AsyncEngine and the HTTP server: text prompts with the added tokens tokenized and outputs
detokenized with the adapter's tokenizer, next to base and plain LoRA requests, greedy tokens
as PEFT on the resized base; typed refusals that leave nothing loaded."""

from __future__ import annotations

import asyncio
import shutil

import aiohttp
import pytest

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import AdapterConfigError, AdapterShapeError, InvalidRequestError
from loraplex.engine.server import create_app, start_server
from loraplex.engine.structured.spec import StructuredOutput
from loraplex.engine.tokenizer import Tokenizer
from tests.helpers.adapters import boost_added_rows, resized_base
from tests.helpers.engine import assert_idle, collect, config
from tests.helpers.models import copy_adapter, make_peft_adapter
from tests.helpers.peft_oracle import HFReference, compare, http_greedy_ids
from tests.helpers.tokenizers import swap_token_ids

pytest.importorskip("peft")

V, ADDED = 256, ("<sql>", "</sql>", "<tbl>")
TOKEN = "added-token"


@pytest.fixture(scope="module")
def added(tiny, tmp_path_factory):
    model_dir, _ = tiny
    root = tmp_path_factory.mktemp("added-tokens")
    folder = make_peft_adapter(
        model_dir, root / "added", seed=81, r=4, alpha=8, target_modules=["q_proj", "v_proj"],
        modules_to_save=["embed_tokens", "lm_head"], added_tokens=ADDED,
    )  # fmt: skip
    boost_added_rows(folder)
    return root, folder, resized_base(model_dir, root / "resized", V + len(ADDED))


def cfg(model_dir, **kw):
    base = dict(max_loras=2, max_cpu_loras=3, max_full_module_loras=1, lora_extra_vocab_size=4)
    return config(model_dir, **{**base, **kw})


async def test_added_tokens_through_the_engine_match_peft(tiny, added):
    model_dir, adapters = tiny
    root, folder, resized = added
    text = "<sql>select name from <tbl> where</sql> the"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(cfg(model_dir)) as engine:
        report = engine.capacity_report()
        assert report["full_module_bytes"] == 2 * (V + 4) * 64 * 4
        assert engine.testing.executor.model.full_modules.embed.shape == (1, V + 4, 64)
        await engine.add_adapter("added", f"file://{folder}")
        await engine.add_adapter("sql", f"file://{adapters['sql']}")
        tok = engine.tokenizer_for("added")
        assert tok is not engine.tokenizer and engine.tokenizer_for("sql") is engine.tokenizer
        ids = tok.encode(text)
        assert {V, V + 1, V + 2} <= set(ids)  # the added tokens, one id each
        base_ids = engine.tokenizer.encode(text)
        work = [
            (text, "added"), (ids[:5], "added"), (text, None), (text, "sql"),
            ([5, 17, 99, 3], None), ([V + 2, 40, V], "added"), (text, "added"),
        ]  # fmt: skip
        outs = await asyncio.gather(*(collect(engine, p, params, a) for p, a in work))
        s = engine.stats()
        assert_idle(engine)
    ref_added = HFReference(resized, {"added": folder})
    ref_other = HFReference(model_dir, {"sql": adapters["sql"]})
    picked_added = False
    for (prompt, a), (tokens, out_text, _) in zip(work, outs, strict=True):
        if isinstance(prompt, str):
            prompt = ids if a == "added" else base_ids
        ref, gaps = (ref_added if a == "added" else ref_other).greedy(prompt, a, 6)
        compare(tokens, ref, gaps)
        if a == "added":
            picked_added |= any(t >= V for t in tokens)
            assert out_text == tok.decode(tokens)  # detokenized with the adapter's tokenizer
        else:
            assert all(t < V for t in tokens)
    assert picked_added  # the adapter's rows sampled its added tokens
    # add_adapter's pass made both images: every request found its adapter in the CPU tier
    assert s["adapters"]["loads"] == 0 and s["adapters"]["misses"] == 0, s["adapters"]


async def test_added_tokens_stop_strings_and_refusals_on_requests(tiny, added):
    model_dir, _ = tiny
    _, folder, _ = added
    async with AsyncEngine(cfg(model_dir)) as engine:
        await engine.add_adapter("added", f"file://{folder}")
        tok = engine.tokenizer_for("added")
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        tokens, text, _ = await collect(engine, "<tbl> x", greedy, "added")
        added_text = next((t for t in ADDED if t in text), None)
        if added_text is not None:  # a stop string made of an added token ends the output
            stop = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[added_text])
            _, cut, outs = await collect(engine, "<tbl> x", stop, "added")
            assert added_text not in cut and outs[-1].finish_reason == "stop"
        # ids past the adapter's vocabulary, or added ids on another adapter / the base
        for prompt, a in (([V + 3, 5], "added"), ([V, 5], None)):
            with pytest.raises(InvalidRequestError, match="prompt token ids"):
                await collect(engine, prompt, greedy, a)
        structured = SamplingParams(max_tokens=4, structured=StructuredOutput("regex", "[a-z]+"))
        with pytest.raises(InvalidRequestError, match="adds tokens"):
            await collect(engine, "x", structured, "added")
        assert_idle(engine)
    assert isinstance(tok, Tokenizer) and tok.vocab_size == V + 3


async def test_bad_added_token_adapters_are_typed_errors(tiny, added, tmp_path):
    model_dir, _ = tiny
    root, folder, _ = added
    bare = copy_adapter(folder, root / "bare")  # no tokenizer.json
    swapped = copy_adapter(folder, root / "swapped")
    swap_token_ids(folder, swapped)
    (swapped / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text())
    cases = [
        ("bare", bare, 4, AdapterConfigError, "no tokenizer.json"),
        ("swapped", swapped, 4, AdapterConfigError, "does not extend the base tokenizer"),
        ("toomany", folder, 2, AdapterShapeError, "lora_extra_vocab_size allows 258"),
    ]
    for name, path, extra, kind, words in cases:
        conf = cfg(model_dir, lora_extra_vocab_size=extra, adapter_cache_dir=str(tmp_path / name))
        async with AsyncEngine(conf) as engine:
            with pytest.raises(kind, match=words):
                await engine.add_adapter(name, f"file://{path}")
            assert engine.list_adapters() == []
            assert engine.stats()["adapters"]["loads"] == 0
            staged = [p for p in (tmp_path / name).rglob("*") if p.is_file()]
            assert staged == []  # its fetched files are gone
    with pytest.raises(ValueError, match="lora_extra_vocab_size needs full-table slots"):
        config(model_dir, lora_extra_vocab_size=4)


async def _post(url: str, body: dict, admin: bool = False) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {TOKEN}"} if admin else {}
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_added_tokens_over_http(tiny, added):
    model_dir, _ = tiny
    root, folder, resized = added
    text = "<sql>select <tbl></sql>"
    async with AsyncEngine(cfg(model_dir, local_roots=(str(root),))) as engine:
        runner, port = await start_server(create_app(engine, admin_token=TOKEN))
        try:
            url = f"http://127.0.0.1:{port}/v1"
            bad = {"lora_name": "bare", "lora_path": str(copy_adapter(folder, root / "bare2"))}
            status, err = await _post(url + "/load_lora_adapter", bad, admin=True)
            assert status == 400 and err["error"]["type"] == "AdapterConfigError", err
            body = {"lora_name": "added", "lora_path": str(folder)}
            status, _ = await _post(url + "/load_lora_adapter", body, admin=True)
            assert status == 200
            req = {"model": "added", "prompt": text, "max_tokens": 6, "temperature": 0.0,
                   "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            status, out = await _post(url + "/completions", req)
            assert status == 200, out
            chat = {"model": "added", "messages": [{"role": "user", "content": text}],
                    "max_tokens": 4, "temperature": 0.0}  # fmt: skip
            status, reply = await _post(url + "/chat/completions", chat)
            assert status == 200, reply
            fmt = {**chat, "response_format": {"type": "json_object"}}
            status, err = await _post(url + "/chat/completions", fmt)
            assert status == 400 and "adds tokens" in err["error"]["message"], err
        finally:
            await runner.cleanup()
        tok = engine.tokenizer_for("added")
        ids = tok.encode(text)
        via_client = await http_greedy_ids(engine, "added", [V + 2, 40, V, 7], 6)
    ref = HFReference(resized, {"added": folder})
    compare(out["choices"][0]["token_ids"], *ref.greedy(ids, "added", 6))
    assert out["choices"][0]["text"] == tok.decode(out["choices"][0]["token_ids"])
    compare(via_client, *ref.greedy([V + 2, 40, V, 7], "added", 6))


async def test_a_name_resolved_at_request_time_that_adds_tokens(tiny, added):
    """With lora_extra_vocab_size > 0 a name resolved at request time is loaded before its
    request is tokenized: the request gets the adapter's tokenizer, as if loaded ahead, and
    counts as one miss; a refused one is a typed error and its name is forgotten."""
    model_dir, _ = tiny
    root, folder, resized = added
    copy_adapter(folder, root / "bare3")  # (no tokenizer.json: refused)
    text = "<sql>select <tbl></sql>"
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    conf = cfg(model_dir, local_roots=(str(root),), lora_name_template=f"file://{root}/{{name}}")
    async with AsyncEngine(conf) as engine:
        assert engine.list_adapters() == []
        first, second = await asyncio.gather(
            collect(engine, text, greedy, "added"), collect(engine, text, greedy, "added")
        )
        tok = engine.tokenizer_for("added")
        assert tok is not engine.tokenizer
        s = engine.stats()["adapters"]
        assert s["loads"] == 1 and s["misses"] >= 1, s
        with pytest.raises(AdapterConfigError, match="no tokenizer.json"):
            await collect(engine, text, greedy, "bare3")
        assert [a["name"] for a in engine.list_adapters()] == ["added"]  # bare3 forgotten
        runner, port = await start_server(create_app(engine))
        try:
            url = f"http://127.0.0.1:{port}/v1"
            req = {"model": "chat-added", "prompt": text, "max_tokens": 6, "temperature": 0.0,
                   "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            shutil.copytree(folder, root / "chat-added", dirs_exist_ok=True)
            status, out = await _post(url + "/completions", req)
            assert status == 200, out
            assert engine.tokenizer_for("chat-added") is not engine.tokenizer
            status, err = await _post(url + "/completions", {**req, "model": "bare3"})
            # (a generation request's adapter that fails to load is a 500, as for any load)
            assert status == 500 and err["error"]["type"] == "AdapterConfigError", err
            assert "no tokenizer.json" in err["error"]["message"]
        finally:
            await runner.cleanup()
        assert_idle(engine)
    ids = tok.encode(text)
    assert {V, V + 1, V + 2} <= set(ids)  # tokenized with the adapter's own tokenizer
    ref = HFReference(resized, {"added": folder})
    for tokens, out_text, _ in (first, second):
        compare(tokens, *ref.greedy(ids, "added", 6))
        assert out_text == tok.decode(tokens)
    compare(out["choices"][0]["token_ids"], *ref.greedy(ids, "added", 6))
