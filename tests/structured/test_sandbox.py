"""The grammar sandbox (structured/sandbox.py) through ``GrammarCache``: constraints that crash
the grammar library, run past the compile budget or need more than the cache holds are refused
with a 400 naming the request field; the engine's process never runs them first."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from loraplex.engine.demo import demo_model_dir
from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.grammars import GrammarCache
from loraplex.engine.tokenizer import Tokenizer
from tests.structured.hostile import defs_chain, gbnf_chain, rule_chain

# found by hostile clients: each ended the server's process (SIGSEGV) before the sandbox
INT_EDGE = {"type": "integer", "minimum": -9223372036854775807, "maximum": -9223372036854775806}


def unchecked(schema: dict, field: str) -> StructuredOutput:
    """A schema past ``schema_check`` (its rules refuse INT_EDGE first): what the sandbox must
    contain when no rule foresaw an input."""
    return StructuredOutput("json", json.dumps(schema), field)


def _cache(**kw) -> GrammarCache:
    tok = Tokenizer.from_dir(demo_model_dir())
    return GrammarCache(tok.backend.to_str, tok.vocab_size, sorted(tok.eos_token_ids), **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed helper may linger as a zombie until reaped
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def cache():
    c = _cache()
    yield c
    c.close()


@pytest.mark.parametrize(
    "spec",
    [
        unchecked(INT_EDGE, "response_format"),
        StructuredOutput.json_schema(defs_chain(1000), "guided_json"),
        StructuredOutput.grammar(rule_chain(3000), "guided_grammar"),
    ],
    ids=["int64-edge", "defs-chain-1000", "rule-chain-3000"],
)
async def test_a_constraint_that_crashes_the_compiler_is_a_400_remembered(cache, spec):
    with pytest.raises(InvalidRequestError) as e:
        await cache.guide(spec)
    assert e.value.field == spec.field
    assert "crashed the grammar compiler" in str(e.value) and "SIG" in str(e.value)
    assert cache.sandbox.crashes == 1 and cache.refused == 1
    with pytest.raises(InvalidRequestError, match="crashed"):  # remembered: not run again
        await cache.guide(spec)
    assert cache.sandbox.crashes == 1
    # the cache goes on serving
    guide = await cache.guide(StructuredOutput.regex("[0-9]{3}", "structured_outputs"))
    assert not guide.failed


async def test_a_crash_is_logged_once_without_the_constraint(cache, capsys):
    import structlog

    spec = unchecked(INT_EDGE, "response_format")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            with pytest.raises(InvalidRequestError):
                await cache.guide(spec)
    refused = [r for r in logs if r["event"] == "grammar_refused"]
    assert len(refused) == 1 and refused[0]["reason"] == "crash"
    assert "9223372036854775806" not in repr(refused)  # a digest, never the request's text


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput.regex(r"[^\s\S]"),
        StructuredOutput.grammar(r"start: /[^\s\S]/"),
        StructuredOutput.json_schema({"$ref": "#"}),
    ],
    ids=["regex", "lark", "self-ref"],
)
async def test_a_constraint_that_accepts_nothing_is_a_400(cache, spec):
    with pytest.raises(InvalidRequestError, match="accepts no output"):
        await cache.guide(spec)


async def test_a_compile_past_the_budget_is_refused_and_its_helper_killed():
    cache = _cache(compile_timeout_s=0.5)
    try:
        with pytest.raises(InvalidRequestError) as e:
            await cache.guide(StructuredOutput.grammar(gbnf_chain(4000), "guided_grammar"))
        assert e.value.field == "guided_grammar"
        assert "--grammar-compile-timeout" in str(e.value)
        assert cache.sandbox.timeouts == 1 and not cache.sandbox.pids  # killed, not running
        guide = await cache.guide(StructuredOutput.regex("[a-c]+"))  # a fresh helper
        assert not guide.failed
    finally:
        cache.close()


async def test_a_compile_whose_waiters_all_left_is_killed(cache):
    # warm one helper, so the pid seen below runs the slow job
    await cache.guide(StructuredOutput.regex("x"))
    (pid,) = cache.sandbox.pids
    spec = StructuredOutput.grammar(gbnf_chain(4000), "guided_grammar")
    waiters = [asyncio.create_task(cache.guide(spec)) for _ in range(3)]
    await asyncio.sleep(0.5)
    waiters[0].cancel()  # one of three leaving cancels nothing
    await asyncio.sleep(0.2)
    assert _alive(pid)
    for w in waiters[1:]:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    for _ in range(50):
        if not _alive(pid):
            break
        await asyncio.sleep(0.1)
    assert not _alive(pid)
    assert spec.key not in cache._cache  # a cancelled compile is not remembered


async def test_the_cache_is_bounded_by_bytes():
    cache = _cache(cache_bytes=64 << 20)
    try:
        # measured weights: each choice list of a few thousand words is ~MBs of matcher
        specs = [
            StructuredOutput.choice([f"w{j}x{i}" for i in range(3000)], "guided_choice")
            for j in range(40)
        ]
        for spec in specs:
            await cache.guide(spec)
            assert cache.nbytes <= cache.cache_bytes or len(cache._cache) == 1
        assert 0 < len(cache._cache) < len(specs)  # evicted by bytes, not by count (128)
        assert specs[-1].key in cache._cache and specs[0].key not in cache._cache
    finally:
        cache.close()


async def test_a_constraint_bigger_than_the_cache_is_refused():
    cache = _cache(cache_bytes=1 << 20)
    try:
        spec = StructuredOutput.choice([f"word{i}" for i in range(20000)], "guided_choice")
        with pytest.raises(InvalidRequestError) as e:
            await cache.guide(spec)
        assert e.value.field == "guided_choice" and "--grammar-cache-bytes" in str(e.value)
    finally:
        cache.close()


async def test_compile_threads_run_at_a_lower_priority(cache):
    import threading

    threads = [t for t in threading.enumerate() if t.name.startswith("loraplex-grammar")]
    assert threads
    for t in threads:
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) >= 10


async def test_integer_ranges_beyond_2_to_53_are_a_400_naming_the_field():
    for schema in (
        {"type": "integer", "minimum": 1e19, "maximum": 2e19},  # answered 2^63 - 1 before
        {"type": "integer", "minimum": -2e19, "maximum": -1e19},  # SIGSEGV before
        {"allOf": [{"type": "integer"}, {"maximum": -9223372036854775806}]},
    ):
        with pytest.raises(InvalidRequestError) as e:
            StructuredOutput.json_schema(schema, "response_format")
        assert e.value.field == "response_format" and "2^53" in str(e.value)


async def test_an_integer_range_inside_2_to_53_is_answered_within_it(cache):
    from loraplex.engine.structured.sandbox_helper import _allowed

    spec = StructuredOutput.json_schema(
        {"type": "integer", "minimum": 2**53 - 9, "maximum": 2**53}, "response_format"
    )
    guide = await cache.guide(spec)
    tok = Tokenizer.from_dir(demo_model_dir())
    eos = set(tok.eos_token_ids)
    out: list[int] = []
    m = guide.matcher
    while not m.is_stopped():
        allowed = [t for t in _allowed(m.compute_bitmask(), cache.vocab_size) if t not in eos]
        if not allowed:
            break
        out.append(allowed[-1])
        m.consume_token(allowed[-1])
    value = json.loads(tok.decode(out))
    assert 2**53 - 9 <= value <= 2**53


async def test_a_refused_input_stays_refused_past_the_grammar_lru():
    cache = _cache(capacity=2)
    try:
        crasher = unchecked(INT_EDGE, "response_format")
        with pytest.raises(InvalidRequestError, match="crashed"):
            await cache.guide(crasher)
        for i in range(4):  # push it out of the compiled grammars' LRU
            await cache.guide(StructuredOutput.regex(f"[0-9]{{{i + 1}}}"))
        assert crasher.key not in cache._cache
        with pytest.raises(InvalidRequestError, match="crashed"):
            await cache.guide(crasher)
        assert cache.sandbox.crashes == 1 and cache.refused == 1  # not run (nor logged) again
    finally:
        cache.close()


async def test_a_timeout_is_not_remembered():
    cache = _cache(compile_timeout_s=0.3)
    try:
        spec = StructuredOutput.grammar(gbnf_chain(4000), "guided_grammar")
        for _ in range(2):
            with pytest.raises(InvalidRequestError, match="--grammar-compile-timeout"):
                await cache.guide(spec)
        assert cache.sandbox.timeouts == 2
    finally:
        cache.close()


def test_numbers_beyond_2_to_53_in_const_and_enum_are_a_400():
    # the fuzz found {"oneOf": [{"const": 2**64}]} answered 18446744073709552000
    # (and {"const": 4.916144486639031e16}, a float, answered 49161444866390310)
    for schema in (
        {"oneOf": [{"const": 2**64}]},
        {"enum": [1, {"a": [-(2**60)]}]},
        {"const": 4.916144486639031e16},
    ):
        with pytest.raises(InvalidRequestError) as e:
            StructuredOutput.json_schema(schema, "guided_json")
        assert e.value.field == "guided_json" and "2^53" in str(e.value)
    StructuredOutput.json_schema({"enum": [2**53, "x", 1.5e-300]}, "guided_json")  # fine
