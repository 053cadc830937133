"""The per-request backoff of speculation (spec/backoff.py, spec/control.py): scripted
acceptance sequences decide when a request is proposed for; per-adapter counters; state
dropped on release; pipelined steps while every request backs off; the config field and flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex.engine import EngineConfig, SamplingParams
from loraplex.engine.errors import SpeculativeConfigError
from loraplex.engine.request import Request
from loraplex.engine.server.cli import build_parser
from loraplex.engine.server.launch import config_from_args
from loraplex.engine.spec.backoff import BACKOFF_FIRST, BACKOFF_MAX, Backoff
from loraplex.engine.spec.control import Speculation
from loraplex.engine.spec.proposer import Proposal

K = 4


class FixedProposer:
    """Proposes K tokens for every request asked (the rule, not the tokens, is under test)."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.released: list[str] = []

    def propose(self, reqs, k):
        self.asked += [r.request_id for r in reqs]
        return [Proposal([7] * k) for _ in reqs]

    def commit(self, req, num_accepted):
        pass

    def release(self, req):
        self.released.append(req.request_id)


def decoding(rid: str, adapter: str | None = None) -> Request:
    req = Request(rid, [5, 6, 7, 8], SamplingParams(max_tokens=10_000))
    req.num_computed = req.num_tokens - 1
    if adapter is not None:
        req.adapter = SimpleNamespace(name=adapter)  # (the counters read its name only)
    return req


def speculation(min_acceptance: float = 0.2) -> tuple[Speculation, FixedProposer]:
    prop = FixedProposer()
    return Speculation(prop, K, 8, 100_000, min_acceptance), prop


def step(spec: Speculation, req: Request, accepted: int | None) -> bool:
    """One decode step of ``req``: proposed for or not; when it was, ``accepted`` of its K
    tokens kept (the verifier's own token appended too). Returns whether it was proposed for."""
    props = spec.propose([req])
    if id(req) not in props:
        req.output_ids.append(9)
        req.num_computed = req.num_tokens - 1
        return False
    assert accepted is not None
    req.output_ids += [7] * accepted + [9]
    req.num_computed = req.num_tokens - 1
    spec.verified(req, len(props[id(req)].tokens), accepted)
    return True


def proposed_steps(spec: Speculation, req: Request, script, steps: int) -> list[int]:
    """Indices of the ``steps`` decode steps at which ``req`` was proposed for; the i-th
    verify step keeps ``script(i)`` tokens."""
    out, verifies = [], 0
    for i in range(steps):
        if step(spec, req, script(verifies)):
            out.append(i)
            verifies += 1
    return out


def test_a_request_with_no_accepted_tokens_backs_off_doubling():
    spec, _ = speculation()
    req = decoding("bad")
    at = proposed_steps(spec, req, lambda i: 0, 200)
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    # each failing probe: BACKOFF_FIRST, 2x, 4x ... decode steps without proposals, capped
    want = [min(BACKOFF_FIRST << i, BACKOFF_MAX) + 1 for i in range(len(gaps))]
    assert gaps == want
    assert len(at) < 10  # of 200 steps
    assert spec.stats()["per_adapter"][""]["backoff_rows"] == 200 - len(at)


def test_a_good_request_keeps_its_proposals_through_a_miss():
    spec, _ = speculation()
    req = decoding("good")
    # mostly all kept, every fifth verify step nothing kept: never backs off
    at = proposed_steps(spec, req, lambda i: 0 if i % 5 == 4 else K, 60)
    assert at == list(range(60))
    assert spec.stats()["per_adapter"][""]["backoff_rows"] == 0


def test_a_request_that_starts_quoting_gets_proposals_again():
    spec, _ = speculation()
    req = decoding("late")
    # junk for its first 3 verify steps (backs off 4, 8, then 16 steps), then it quotes
    at = proposed_steps(spec, req, lambda i: 0 if i < 3 else K, 80)
    assert at[:3] == [0, 5, 14]
    assert at[3] == 31  # the probe after the third backoff succeeds...
    assert at[3:] == list(range(31, 80))  # ...and the backoff is reset: proposals every step
    # a later bad patch backs off from BACKOFF_FIRST again (the doubling was reset)
    req2 = decoding("late2")
    script = [0, 0, K, K, K, 0, 0, 0, 0, 0]
    at = proposed_steps(spec, req2, lambda i: script[i] if i < len(script) else 0, 40)
    assert at[:5] == [0, 5, 14, 15, 16]
    gaps = [b - a for a, b in zip(at[4:], at[5:], strict=False)]
    assert gaps[:2] == [1, 1] and BACKOFF_FIRST + 1 in gaps


def test_partial_acceptance_estimate():
    """Per-position acceptance: L kept of K tested L + 1 positions (L when all kept)."""
    back = Backoff(0.2)
    req = decoding("r")
    back.verified(req, K, 1)  # 1 of 2 tested
    assert back.estimate(req) == pytest.approx(0.5)
    back.verified(req, K, K)  # 0.5 * (1, 2) + (4, 4)
    assert back.estimate(req) == pytest.approx(4.5 / 5)
    assert back.allows(req)
    back.verified(req, 2, 2)  # a proposal cut to 2, both kept: no rejection tested
    assert back.estimate(req) == pytest.approx((2.25 + 2) / (2.5 + 2))


def test_threshold_zero_always_proposes():
    spec, prop = speculation(0.0)
    req = decoding("r")
    assert proposed_steps(spec, req, lambda i: 0, 30) == list(range(30))
    assert len(spec.backoff) == 0


def test_per_adapter_counts_and_release():
    spec, prop = speculation()
    good, bad = decoding("g", "sql"), decoding("b")
    for _ in range(20):
        props = spec.propose([good, bad])
        for req, acc in ((good, K), (bad, 0)):
            if id(req) in props:
                req.output_ids += [7] * acc + [9]
                spec.verified(req, K, acc)
            else:
                req.output_ids.append(9)
            req.num_computed = req.num_tokens - 1
    s = spec.stats()
    sql, base = s["per_adapter"]["sql"], s["per_adapter"][""]
    assert sql["proposed_tokens"] == 20 * K and sql["accepted_tokens"] == 20 * K
    assert sql["acceptance_lengths"] == [0, 0, 0, 0, 20] and sql["backoff_rows"] == 0
    verifies = sum(base["acceptance_lengths"])
    assert base["acceptance_lengths"][0] == verifies and base["accepted_tokens"] == 0
    assert base["proposed_tokens"] == verifies * K and base["backoff_rows"] == 20 - verifies
    assert prop.asked.count("g") == 20 and prop.asked.count("b") == verifies
    assert s["min_acceptance"] == 0.2
    spec.release(good)
    spec.release(bad)
    assert len(spec.backoff) == 0 and prop.released == ["g", "b"]


def test_state_does_not_grow_over_many_requests():
    spec, _ = speculation()
    for n in range(500):
        req = decoding(f"r{n}")
        proposed_steps(spec, req, lambda i, kept=n % 3: kept, 12)
        spec.release(req)
    assert len(spec.backoff) == 0


def test_asking_and_chaining_skip_backing_off_requests():
    spec, _ = speculation()
    req = decoding("r")
    other = decoding("o")
    assert spec.asking([req, other]) == [req, other] and spec.wanted_after([req])
    step(spec, req, 0)  # backs off BACKOFF_FIRST tokens
    assert spec.asking([req, other]) == [other]
    assert not spec.wanted_after([req])  # a step after one in flight may be chained
    assert spec.wanted_after([req, other])
    for _ in range(BACKOFF_FIRST - 1):
        step(spec, req, None)
    assert not spec.asking([req]) and spec.wanted_after([req])  # its next token: a probe
    opted_out = Request("x", [1, 2, 3], SamplingParams(speculative=False))
    assert not spec.wanted_after([opted_out])


def test_config_field_and_flags():
    cfg = EngineConfig()
    assert cfg.speculative_min_acceptance == 0.2
    assert (cfg.speculative_ngram_min, cfg.speculative_ngram_max) == (1, 4)
    for bad in (-0.1, 1.0, "0.3", True):
        with pytest.raises(SpeculativeConfigError) as e:
            EngineConfig(speculative_min_acceptance=bad)
        assert e.value.field == "speculative_min_acceptance"
    for kw, field in (
        (dict(speculative_ngram_min=0), "speculative_ngram_min"),
        (dict(speculative_ngram_max=65), "speculative_ngram_max"),
        (dict(speculative_ngram_min=3, speculative_ngram_max=2), "speculative_ngram_min"),
    ):
        with pytest.raises(SpeculativeConfigError) as e:
            EngineConfig(**kw)
        assert e.value.field == field
    args = ["serve", "--speculative-method", "ngram", "--speculative-min-acceptance", "0",
            "--speculative-ngram-min", "2", "--speculative-ngram-max", "6"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(args))
    assert cfg.speculative_min_acceptance == 0.0
    assert (cfg.speculative_ngram_min, cfg.speculative_ngram_max) == (2, 6)
    spec = Speculation.from_config(cfg, 1000)
    assert (spec.proposer.min_n, spec.proposer.max_n) == (2, 6)
    assert spec.backoff.min_acceptance == 0.0
    with pytest.raises(SpeculativeConfigError, match="--speculative-min-acceptance"):
        config_from_args(build_parser().parse_args([*args[:3], "--speculative-min-acceptance",
                                                    "1.5"]))  # fmt: skip
