"""The draft-model proposer in the engine (``speculative_method`` "draft", tiny random Llamas on
the CPU): greedy output token-identical with and without it on mixed batches (base rows and
adapter rows) with a different draft model and with the target itself as draft (which then
accepts nearly everything); draft adapters mapped per target adapter; sampled rows distributed
as without speculation (chi-square of many seeded requests against the exact distribution);
start-up refusals; an aborted or preempted request leaves no draft blocks behind."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.errors import SpeculativeConfigError
from loraplex.engine.spec.draft import DraftProposer
from loraplex.engine.spec.draft_check import DraftModelMismatchError
from loraplex.engine.spec.draft_start import draft_blocks_for
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.models import make_peft_adapter, make_tiny_model
from tests.helpers.stats import chi2_limit
from tests.helpers.tokenizers import make_tokenizer

NAMES = [None, "sql", "poem", "chat", "math"]
SMALL = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def other(tmp_path_factory, tiny):
    """A different tiny random model (smaller, the target's vocabulary and tokenizer) and a
    LoRA adapter of it."""
    root = tmp_path_factory.mktemp("draft")
    d = make_tiny_model(root / "draft", kind="llama", seed=21, **SMALL)
    make_tokenizer(d)
    return d, {"dsql": make_peft_adapter(d, root / "dsql", r=4, seed=5)}


def draft_of(engine: AsyncEngine) -> DraftProposer:
    proposer = engine.testing.scheduler.spec.proposer
    assert isinstance(proposer, DraftProposer)
    return proposer


def assert_no_draft_state(draft: DraftProposer) -> None:
    assert draft.blocks.num_free_blocks == draft.blocks.num_blocks
    assert not draft._seqs


async def run(model_dir, adapters, reqs, **cfg_kw):
    cfg_kw.setdefault("speculative_max_running", 16)
    cfg = config(model_dir, max_loras=4, max_cpu_loras=4, max_num_batched_tokens=128, **cfg_kw)
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        results = await asyncio.gather(
            *(
                collect(engine, p, SamplingParams(**kw), adapter=a, request_id=rid)
                for rid, p, a, kw in reqs
            )
        )
        stats = engine.stats()
        assert_idle(engine)
        if cfg.speculative_method == "draft":
            assert_no_draft_state(draft_of(engine))
    return [(tokens, outs[-1].finish_reason) for tokens, _, outs in results], stats


def greedy_requests(seed: int, n: int = 10) -> list[tuple]:
    g = random.Random(seed)
    return [
        (
            f"r{i}",
            [g.randrange(3, 250) for _ in range(g.randint(2, 20))],
            NAMES[i % 5],
            dict(max_tokens=g.randint(4, 20), temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]


def rate(stats: dict, name: str) -> float:
    per = stats["speculative"]["per_adapter"][name]
    return per["accepted_tokens"] / max(1, per["proposed_tokens"])


async def test_greedy_identical_with_another_draft_and_with_the_target_as_draft(tiny, other):
    model_dir, adapters = tiny
    draft_dir, draft_adapters = other
    reqs = greedy_requests(1)
    plain, _ = await run(model_dir, adapters, reqs)
    spec, stats = await run(
        model_dir, adapters, reqs, speculative_method="draft",
        speculative_model=str(draft_dir),
        speculative_draft_adapters={"sql": draft_adapters["dsql"]},
    )  # fmt: skip
    assert spec == plain
    other_rate = stats["speculative"]["acceptance_rate"]
    assert stats["speculative"]["proposed_tokens"] > 0
    assert set(stats["speculative"]["per_adapter"]) == {"", "sql", "poem", "chat", "math"}
    # the target as its own draft (its adapters as the draft adapters): nearly all accepted
    same, stats = await run(
        model_dir, adapters, reqs, speculative_method="draft",
        speculative_model=str(model_dir), speculative_draft_adapters=adapters,
    )  # fmt: skip
    assert same == plain
    s = stats["speculative"]
    assert s["proposed_tokens"] > 50 and s["acceptance_rate"] >= 0.9, s
    assert s["acceptance_rate"] > other_rate


async def test_draft_adapters_are_mapped_per_target_adapter(tiny):
    """The target as its own draft: "sql" requests draft with the base unless "sql"'s own
    folder is mapped to them, and accept far more once it is."""
    model_dir, adapters = tiny
    reqs = [r for r in greedy_requests(2, 15) if r[2] in (None, "sql")]
    plain, _ = await run(model_dir, adapters, reqs)
    kw = dict(speculative_method="draft", speculative_model=str(model_dir))
    unmapped, s0 = await run(model_dir, adapters, reqs, **kw)
    mapped, s1 = await run(
        model_dir, adapters, reqs, **kw, speculative_draft_adapters={"sql": adapters["sql"]}
    )
    assert unmapped == plain and mapped == plain
    assert rate(s0, "") >= 0.9 and rate(s1, "") >= 0.9
    assert rate(s1, "sql") >= 0.9 > rate(s0, "sql") + 0.2, (rate(s0, "sql"), rate(s1, "sql"))


@torch.no_grad()
def exact_pairs(model_dir, adapter_dir, prompt, temperature, top_k) -> dict[tuple[int, int], float]:
    """P(first two output tokens = (a, b)) of ``prompt`` on the adapter, sampled at
    ``temperature`` within the top ``top_k``: HF transformers + PEFT."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()

    def dist(tokens: list[int]) -> dict[int, float]:
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].float() / temperature
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(), strict=True))

    return {
        (a, b): pa * pb for a, pa in dist(prompt).items() for b, pb in dist(prompt + [a]).items()
    }


def chi2_stat(pairs: list[tuple[int, int]], exact: dict[tuple[int, int], float]) -> float:
    outside = [p for p in pairs if p not in exact]
    assert not outside, outside[:5]
    n = len(pairs)
    counts = {cell: 0 for cell in exact}
    for p in pairs:
        counts[p] += 1
    return sum((counts[c] - n * q) ** 2 / (n * q) for c, q in exact.items())


async def test_sampled_rows_follow_the_target_distribution(tiny):
    """Many seeded requests of 3 tokens on "sql", drafted by the target's base (a draft
    distribution near the target's, not equal: proposals are accepted and rejected): the
    first two tokens (the second one verified: kept, or corrected from the residual) follow
    the exact distribution, as they do without speculation (the oracle's own check)."""
    model_dir, adapters = tiny
    prompt, n, temperature, top_k = [1, 30, 31, 32, 33], 600, 1.5, 4
    exact = exact_pairs(model_dir, adapters["sql"], prompt, temperature, top_k)
    params = dict(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True)
    reqs = [(f"s{i}", prompt, "sql", dict(params, seed=i)) for i in range(n)]
    kw = dict(max_num_seqs=64, speculative_max_running=64)
    plain, _ = await run(model_dir, {"sql": adapters["sql"]}, reqs, **kw)
    spec, stats = await run(
        model_dir, {"sql": adapters["sql"]}, reqs, **kw, speculative_method="draft",
        speculative_model=str(model_dir),
    )  # fmt: skip
    limit = chi2_limit(len(exact) - 1)
    for out in (plain, spec):
        assert all(len(tokens) == 3 for tokens, _ in out)
        stat = chi2_stat([(t[0], t[1]) for t, _ in out], exact)
        assert stat < limit, (stat, limit)
    s = stats["speculative"]
    assert s["proposed_tokens"] >= n // 2
    assert 0.2 < s["acceptance_rate"] < 0.95, s  # both branches taken


async def test_the_draft_runs_in_the_step_thread_not_on_the_event_loop(tiny, other):
    """A draft forward on the event loop would stall every stream's I/O (and, on the CPU, its
    threads would fight the step thread's): the draft proposes in the step thread."""
    model_dir, adapters = tiny
    draft_dir, _ = other
    cfg = config(model_dir, speculative_method="draft", speculative_model=str(draft_dir))
    threads = []
    async with AsyncEngine(cfg) as engine:
        draft = draft_of(engine)
        inner = draft.propose

        def spy(reqs, k):
            threads.append(threading.get_ident())
            return inner(reqs, k)

        draft.propose = spy  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        await collect(engine, [5, 6, 7], params)
    assert threads and threading.get_ident() not in threads


async def test_start_up_refuses_a_mismatched_or_missing_draft(tiny, tmp_path):
    model_dir, adapters = tiny
    wide = make_tiny_model(tmp_path / "wide", kind="llama", seed=3, vocab_size=320, **SMALL)
    make_tokenizer(wide)
    kw = dict(speculative_method="draft")
    with pytest.raises(DraftModelMismatchError, match="--speculative-model.*vocab_size") as e:
        async with AsyncEngine(config(model_dir, **kw, speculative_model=str(wide))):
            pass
    assert e.value.field == "speculative_model"
    with pytest.raises(SpeculativeConfigError, match="no config.json") as e2:
        async with AsyncEngine(config(model_dir, **kw, speculative_model=str(tmp_path / "no"))):
            pass
    assert e2.value.field == "speculative_model"
    bad = {"sql": str(tmp_path / "missing-adapter")}
    with pytest.raises(SpeculativeConfigError, match="missing-adapter") as e3:
        async with AsyncEngine(
            config(
                model_dir, **kw, speculative_model=str(model_dir), speculative_draft_adapters=bad
            )
        ):
            pass
    assert e3.value.field == "speculative_draft_adapters"


async def test_preempted_and_aborted_requests_leave_no_draft_blocks(tiny, other):
    """A tiny KV pool preempts requests: a preempted request's draft state goes with its KV
    (checked at every proposal: the draft holds state only for running requests), output
    stays identical; an aborted request's draft state is gone at once."""
    model_dir, adapters = tiny
    draft_dir, _ = other
    g = random.Random(5)
    reqs = [
        (f"p{i}", [g.randrange(3, 250) for _ in range(g.randint(6, 14))],
         g.choice([None, "sql", "poem"]), dict(max_tokens=12, temperature=0.0, ignore_eos=True))
        for i in range(8)
    ]  # fmt: skip
    plain, _ = await run(model_dir, adapters, reqs, num_kv_blocks=16)
    kw = dict(speculative_method="draft", speculative_model=str(draft_dir), num_kv_blocks=16)
    cfg = config(model_dir, max_loras=4, max_cpu_loras=4, speculative_max_running=16, **kw)
    strays = []
    async with AsyncEngine(cfg) as engine:
        await register(engine, adapters)
        draft = draft_of(engine)
        scheduler = engine.testing.scheduler
        inner = draft.propose

        def checked(batch, k):
            running = {r.request_id for r in scheduler.running}
            strays.extend(set(draft._seqs) - running)
            strays.extend(rid for rid in draft.blocks._tables if rid not in running)
            return inner(batch, k)

        draft.propose = checked  # type: ignore[method-assign]
        spec = await asyncio.gather(
            *(
                collect(engine, p, SamplingParams(**kw), adapter=a, request_id=rid)
                for rid, p, a, kw in reqs
            )
        )
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["speculative"]["proposed_tokens"] > 0
        assert_no_draft_state(draft)
        # abort one of two requests mid-stream
        long = asyncio.create_task(
            collect(engine, [9, 8, 7], SamplingParams(max_tokens=40, ignore_eos=True))
        )
        seen = []
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        async for out in engine.generate([7, 8, 9], params, request_id="to-abort"):
            seen.append(out)
            if len(seen) == 3:
                engine.abort("to-abort")
        assert seen[-1].finish_reason == "abort"
        assert "to-abort" not in draft._seqs and "to-abort" not in draft.blocks
        await long
        assert_idle(engine)
        assert_no_draft_state(draft)
    assert not strays, strays
    assert [(t, o[-1].finish_reason) for t, _, o in spec] == plain


@pytest.mark.gpu
async def test_on_gpu_graphs_shared_budget_and_no_compiles_while_serving(tiny, other):
    """On CUDA (float32, fused forward, CUDA graphs for the target, its verification steps
    and the draft): the KV budget of the free memory is split between the two caches, greedy
    tokens are PEFT's with another draft and with the target as its own draft (which accepts
    nearly all), and no kernel compiles after start-up."""
    from tests.helpers.peft_oracle import HFReference, compare

    model_dir, adapters = tiny
    draft_dir, draft_adapters = other
    g = random.Random(9)
    work = [
        ([g.randrange(3, 250) for _ in range(g.randint(1, 40))], g.choice(NAMES)) for _ in range(12)
    ]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    hf = HFReference(model_dir, adapters)
    refs = [hf.greedy(p, a, 10) for p, a in work]
    drafts = [
        (str(draft_dir), {"sql": draft_adapters["dsql"]}),
        (str(model_dir), adapters),
    ]
    for draft_model, mapping in drafts:
        cfg = config(
            model_dir, device="cuda", max_loras=4, max_cpu_loras=4, max_num_batched_tokens=128,
            max_num_seqs=16, speculative_method="draft", speculative_model=draft_model,
            speculative_draft_adapters=mapping, speculative_max_running=16,
        )  # fmt: skip
        async with AsyncEngine(cfg) as engine:
            draft = draft_of(engine)
            assert draft.runner is not None and draft.runner.graphs is not None
            n = engine.stats()["num_blocks"]
            assert draft.blocks.num_blocks == draft_blocks_for(cfg, n)
            await register(engine, adapters)
            before = engine.stats()["kernel_compiles_while_serving"]
            outs = await asyncio.gather(*(collect(engine, p, params, a) for p, a in work))
            for (tokens, _, _), ref in zip(outs, refs, strict=True):
                compare(tokens, *ref)
            stats = engine.stats()
            assert stats["kernel_compiles_while_serving"] == before
            assert stats["speculative"]["proposed_tokens"] > 0
            # verification steps replay the wide mixed graphs (mixed_graphs.py), not eager
            verifies = [e for e in engine.testing.step_log if e.verify]
            assert verifies and all(e.gpu_ms is not None for e in verifies), verifies[:3]
            if draft_model == str(model_dir):
                assert stats["speculative"]["acceptance_rate"] >= 0.9, stats["speculative"]
            assert_idle(engine)
            assert_no_draft_state(draft)
