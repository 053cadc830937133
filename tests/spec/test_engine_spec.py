"""Speculative decoding in the engine (tiny random Llama, four adapters, CPU): greedy output is
token-identical with and without it on mixed batches (base rows, adapters, a structured-output
row, stop strings and tokens, max_tokens, min_tokens, logprobs); rejected positions' KV is
rolled back (blocks return, the prefix cache holds what it holds without speculation); the
per-request opt-out and the large-batch switch-off; the metrics."""

from __future__ import annotations

import asyncio
import random

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.spec.proposer import Proposal
from loraplex.engine.structured import StructuredOutput
from tests.helpers.engine import assert_idle, collect, config, register

NAMES = [None, "sql", "poem", "chat", "math"]


class OracleProposer:
    """Proposes a reference run's next tokens (what greedy decoding will emit), corrupting
    some positions, so that rows keep 0..k tokens: exercises multi-token acceptance, partial
    rejections and the bonus token on a random model (where prompt lookup rarely hits)."""

    def __init__(self, reference: dict[str, list[int]], seed: int = 0) -> None:
        self.reference = reference
        self.rng = random.Random(seed)
        self.committed: list[int] = []

    def propose(self, reqs, k):
        out = []
        for r in reqs:
            ref = self.reference.get(r.request_id, [])
            n = len(r.output_ids)
            toks = list(ref[n : n + k])
            if toks and self.rng.random() < 0.5:
                toks[self.rng.randrange(len(toks))] = self.rng.randrange(3, 250)
            if self.rng.random() < 0.15:  # past the reference's end: made-up tokens
                toks += [self.rng.randrange(3, 250) for _ in range(k - len(toks))]
            out.append(Proposal(toks[:k]))
        return out

    def commit(self, req, num_accepted):
        self.committed.append(num_accepted)

    def release(self, req):
        pass


def requests(seed: int) -> list[tuple]:
    g = random.Random(seed)
    out = []
    for i in range(10):
        prompt = [g.randrange(3, 250) for _ in range(g.randint(2, 20))]
        kw = dict(max_tokens=g.randint(3, 24), temperature=0.0, ignore_eos=True)
        if i % 4 == 1:
            kw.update(logprobs=2)
        if i % 5 == 3:
            kw.update(min_tokens=3, ignore_eos=False)
        out.append((f"r{i}", prompt, NAMES[i % 5], kw))
    return out


async def run(
    model_dir, adapters, reqs, *, method=None, reference=None, extra=None, wrap=None, **cfg_kw
):
    cfg_kw.setdefault("speculative_max_running", 16)
    cfg = config(model_dir, max_loras=4, max_cpu_loras=4, speculative_method=method, **cfg_kw)
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        for name in adapters:  # every adapter resident first
            await collect(engine, [5, 6], SamplingParams(max_tokens=1), adapter=name)
        oracle = None
        if reference is not None:
            oracle = OracleProposer(reference)
            engine.testing.scheduler.spec.proposer = oracle
        if wrap is not None:
            spec = engine.testing.scheduler.spec
            spec.proposer = wrap(engine, spec.proposer)
        results = await asyncio.gather(
            *(
                collect(
                    engine,
                    p,
                    SamplingParams(**kw, **(extra or {}).get(rid, {})),
                    adapter=a,
                    request_id=rid,
                )  # fmt: skip
                for rid, p, a, kw in reqs
            )
        )
        stats = engine.stats()
        cached = set(engine.testing.scheduler.blocks._cached)
        spec = engine.testing.scheduler.spec
        assert spec is None or len(spec.backoff) == 0  # per-request state left with them
        assert_idle(engine)
        assert stats["num_free_blocks"] == stats["num_blocks"]
    return results, stats, cached, oracle


def summary(results):
    """Per request: tokens, text, finish and stop reason, and per logprob entry (token id,
    logprob, top ids). Compare two with ``same``: logprobs within float32 noise."""
    return [
        (
            tokens,
            text,
            outs[-1].finish_reason,
            outs[-1].stop_reason,
            [
                (lp.token_id, lp.logprob, [t for t, _ in lp.top])
                for o in outs
                for lp in o.logprobs or []
            ],
        )  # fmt: skip
        for tokens, text, outs in results
    ]


def same(got, want, tol: float = 1e-4) -> bool:
    """``summary`` entries (or lists of them) equal, logprob values within ``tol``: a row
    computed among other rows (or as a verify row) rounds differently in the last float32
    bits, and a value at a rounding boundary once read -0.3561 against -0.3562 at 4 decimals."""
    if isinstance(got, list):
        return len(got) == len(want) and all(
            same(g, w, tol) for g, w in zip(got, want, strict=True)
        )
    if got[:4] != want[:4] or len(got[4]) != len(want[4]):
        return False
    return all(
        a[0] == b[0] and a[2] == b[2] and abs(a[1] - b[1]) <= tol
        for a, b in zip(got[4], want[4], strict=True)
    )


async def test_greedy_identical_on_a_mixed_batch_with_stops(tiny):
    model_dir, adapters = tiny
    reqs = requests(1)
    plain, _, _, _ = await run(model_dir, adapters, reqs)
    # stop conditions that land inside a verified row: a stop string taken from the middle
    # of a reference output, a stop token id, a shorter max_tokens
    extra = {}
    for i, ((rid, *_), (tokens, text, _)) in enumerate(zip(reqs, plain, strict=True)):
        if i % 3 == 0 and len(text) > 6:
            extra[rid] = {"stop": [text[len(text) // 2 : len(text) // 2 + 3]]}
        elif i % 3 == 1 and len(tokens) > 4:
            extra[rid] = {"stop_token_ids": [tokens[len(tokens) // 2]]}
    plain, _, cached_plain, _ = await run(model_dir, adapters, reqs, extra=extra)
    reference = {rid: res[0] for (rid, *_), res in zip(reqs, plain, strict=True)}
    spec, stats, cached_spec, oracle = await run(
        model_dir, adapters, reqs, method="ngram", reference=reference, extra=extra
    )
    assert same(summary(spec), summary(plain))
    assert any(o[2] == "stop" for o in summary(plain))
    # several tokens were kept in one step, and rows were rejected partway
    assert max(oracle.committed) >= 2 and min(oracle.committed) == 0
    s = stats["speculative"]
    assert s["accepted_tokens"] == sum(oracle.committed) > 0
    assert set(s["per_adapter"]) == {"", "sql", "poem", "chat", "math"}
    for per in s["per_adapter"].values():
        assert sum(i * c for i, c in enumerate(per["acceptance_lengths"])) == per["accepted_tokens"]
    # the prefix cache never saw a rejected token: it holds exactly the plain run's blocks
    assert cached_spec == cached_plain


async def test_ngram_on_a_repeating_prompt_is_identical_and_accepts(tiny):
    model_dir, adapters = tiny
    loop = [11, 12, 13, 14, 15, 16, 17, 18]
    reqs = [(f"q{i}", loop * 4 + loop[: 2 + i], NAMES[i], dict(max_tokens=20, temperature=0.0,
            ignore_eos=True)) for i in range(3)]  # fmt: skip
    plain, _, _, _ = await run(model_dir, adapters, reqs)
    spec, stats, _, _ = await run(model_dir, adapters, reqs, method="ngram")
    assert same(summary(spec), summary(plain))
    assert stats["speculative"]["proposed_tokens"] > 0


async def test_structured_row_greedy_identical(tiny):
    model_dir, adapters = tiny
    schema = StructuredOutput("regex", "(ab|cd|[0-9]){3,12}")
    reqs = [
        ("s0", [40, 41, 42, 43], None, dict(max_tokens=16, temperature=0.0, structured=schema)),
        ("s1", [50, 51, 52], "sql", dict(max_tokens=16, temperature=0.0, structured=schema)),
        ("f0", [60, 61, 62, 63], "poem", dict(max_tokens=12, temperature=0.0, ignore_eos=True)),
    ]
    plain, _, _, _ = await run(model_dir, adapters, reqs)
    reference = {rid: res[0] for (rid, *_), res in zip(reqs, plain, strict=True)}
    spec, stats, _, oracle = await run(
        model_dir, adapters, reqs, method="ngram", reference=reference
    )
    assert same(summary(spec), summary(plain))
    assert stats["speculative"]["accepted_tokens"] > 0


async def test_opt_out_and_large_batch_switch_off(tiny):
    model_dir, adapters = tiny
    loop = [21, 22, 23, 24, 25, 26]
    p = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [("a", loop * 4, None, dict(p, speculative=False))]
    _, stats, _, _ = await run(model_dir, adapters, reqs, method="ngram")
    assert stats["speculative"]["proposed_tokens"] == 0
    # three requests run at once, speculation only while at most one runs: none proposed
    # until two of them finished (the short ones)
    reqs = [
        ("b", loop * 4, None, dict(p, max_tokens=2)),
        ("c", loop * 4, None, dict(p, max_tokens=2)),
        ("d", loop * 4, None, dict(p, max_tokens=30)),
    ]
    seen = []

    class Recording:
        def __init__(self, engine, inner):
            self.engine, self.inner = engine, inner

        def propose(self, reqs, k):
            seen.append(len(self.engine.testing.scheduler.running))
            return self.inner.propose(reqs, k)

        def commit(self, req, n):
            self.inner.commit(req, n)

        def release(self, req):
            self.inner.release(req)

    plain, _, _, _ = await run(model_dir, adapters, reqs)
    spec, stats, _, _ = await run(
        model_dir, adapters, reqs, method="ngram", speculative_max_running=1, wrap=Recording
    )
    assert same(summary(spec), summary(plain))
    assert seen and max(seen) == 1
    assert stats["speculative"]["proposed_tokens"] > 0


async def test_seeded_sampled_rows_keep_their_own_generator(tiny):
    """A seeded sampled row's tokens depend only on its seed and its own proposals: alone or
    among other rows (sampled, greedy, adapters), with speculation, the same."""
    model_dir, adapters = tiny
    loop = [41, 42, 43, 44, 45, 46]
    sampled = dict(max_tokens=20, temperature=0.9, top_k=20, top_p=0.95, ignore_eos=True)
    me = ("me", loop * 4, "sql", dict(sampled, seed=7, logprobs=1))
    others = [
        (f"o{i}", loop * 3 + [50 + i], NAMES[i % 5], dict(sampled, seed=None if i % 2 else i))
        for i in range(5)
    ]
    alone, stats, _, _ = await run(model_dir, adapters, [me], method="ngram")
    assert stats["speculative"]["proposed_tokens"] > 0
    mixed, stats, _, _ = await run(model_dir, adapters, [me, *others], method="ngram")
    assert same(summary(mixed)[0], summary(alone)[0])
    assert all(len(t) == 20 for t, _, _ in mixed)


class SplitProposer:
    """Proposes the reference's next tokens (all kept, greedy) for requests whose id starts
    with "q" and tokens that can never be kept (each the reference's plus one) for the rest:
    the backoff must stop the latter and keep the former."""

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference = reference
        self.asked: dict[str, int] = {}

    def propose(self, reqs, k):
        out = []
        for r in reqs:
            self.asked[r.request_id] = self.asked.get(r.request_id, 0) + 1
            n = len(r.output_ids)
            toks = list(self.reference[r.request_id][n : n + k])
            if not r.request_id.startswith("q"):
                toks = [3 + (t + 1) % 240 for t in toks]
            out.append(Proposal(toks))
        return out

    def commit(self, req, num_accepted):
        pass

    def release(self, req):
        pass


async def test_backoff_keeps_greedy_identical_and_stops_junk_per_adapter(tiny):
    model_dir, adapters = tiny
    p = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [
        ("q0", [70, 71, 72, 73], "sql", p),
        ("j0", [80, 81, 82], None, p),
        ("j1", [90, 91, 92, 93, 94], "poem", dict(p, max_tokens=30)),
    ]
    plain, _, _, _ = await run(model_dir, adapters, reqs)
    reference = {rid: res[0] for (rid, *_), res in zip(reqs, plain, strict=True)}
    split = None

    def wrap(engine, inner):
        nonlocal split
        split = SplitProposer(reference)
        return split

    spec, stats, _, _ = await run(model_dir, adapters, reqs, method="ngram", wrap=wrap)
    assert same(summary(spec), summary(plain))
    per = stats["speculative"]["per_adapter"]
    # the quoting request: every proposal kept, never backed off, ~K + 1 tokens per step
    assert per["sql"]["backoff_rows"] == 0 and per["sql"]["accepted_tokens"] >= 30
    assert split.asked["q0"] <= 40 // 4
    # the junk ones: a probe after 4, 8, 16 ... tokens, nothing kept
    for name, rid, steps in (("", "j0", 39), ("poem", "j1", 29)):
        assert per[name]["accepted_tokens"] == 0 and per[name]["backoff_rows"] > 0
        assert split.asked[rid] <= 5  # of 30-40 decode steps
        # every decode step was proposed for or counted (pipelined steps included)
        assert split.asked[rid] + per[name]["backoff_rows"] == steps
    # and with the rule off, the junk requests are proposed for at every step
    off, stats, _, _ = await run(
        model_dir, adapters, reqs, method="ngram", wrap=wrap, speculative_min_acceptance=0.0
    )
    assert same(summary(off), summary(plain))
    assert split.asked["j0"] == 39 and stats["speculative"]["per_adapter"][""]["backoff_rows"] == 0
