"""SamplingParams validation and the batched Sampler."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.sampler import Sampler, SamplerOutput, make_generator, min_tokens_banned_ids
from loraplex.engine.sampling_params import InvalidSamplingParams, SamplingParams

V = 64


def _logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * 3


# -- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_params_reject_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    assert field in str(info.value)


def test_params_normalise() -> None:
    p = SamplingParams(stop="###", top_k=0, temperature=0, logprobs=20)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == -1
    assert p.greedy and isinstance(p.temperature, float)
    assert SamplingParams().stop == [] and not SamplingParams().greedy
    assert SamplingParams(top_k=1).greedy
    assert p.clone(temperature=0.5).temperature == 0.5
    with pytest.raises(InvalidSamplingParams):
        p.clone(top_p=2.0)


def test_min_tokens_banned_ids() -> None:
    p = SamplingParams(min_tokens=3, stop_token_ids=[7])
    assert min_tokens_banned_ids(p, 0, {2}) == [2, 7]
    assert min_tokens_banned_ids(p, 3, {2}) == []
    assert min_tokens_banned_ids(p.clone(ignore_eos=True), 1, {2}) == [7]


# -- Sampler -----------------------------------------------------------------------------------


def test_greedy_is_argmax_in_mixed_batch() -> None:
    logits = _logits(6)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.0, seed=3),
    ]
    gens = [None] * 5 + [make_generator(3)]
    out = Sampler().sample(logits, params, gens)
    assert isinstance(out, SamplerOutput) and len(out.token_ids) == 6
    argmax = logits.argmax(-1).tolist()
    for i in (0, 2, 3, 5):
        assert out.token_ids[i] == argmax[i]
    assert out.logprobs == [None] * 6 and out.top_logprobs == [None] * 6


def test_top_k_1_equals_greedy() -> None:
    logits = _logits(32, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32
    out = Sampler().sample(logits, params, [None] * 32)
    assert out.token_ids == logits.argmax(-1).tolist()


def _seeded_run(rows: list[tuple[SamplingParams, int | None]], row: int, steps: int) -> list[int]:
    gens = [None if s is None else make_generator(s) for _, s in rows]
    sampler = Sampler()
    logits = _logits(1, seed=42).expand(len(rows), V).contiguous()
    return [sampler.sample(logits, [p for p, _ in rows], gens).token_ids[row] for _ in range(steps)]


def test_seeded_rows_do_not_depend_on_batch() -> None:
    target = (SamplingParams(temperature=1.0, top_p=0.95, seed=1234), 1234)
    alone = _seeded_run([target], 0, 20)
    mixed = _seeded_run(
        [
            (SamplingParams(temperature=0.3), None),
            (SamplingParams(temperature=2.0, seed=5), 5),
            target,
            (SamplingParams(temperature=0.0), None),
        ],
        2,
        20,
    )
    assert alone == mixed
    other = _seeded_run([(SamplingParams(temperature=1.0, top_p=0.95, seed=99), 99)], 0, 20)
    assert other != alone


def test_sampler_seed_makes_unseeded_rows_reproducible() -> None:
    logits, params = _logits(8), [SamplingParams()] * 8
    a = Sampler(seed=0).sample(logits, params, [None] * 8).token_ids
    b = Sampler(seed=0).sample(logits, params, [None] * 8).token_ids
    assert a == b


def test_make_generator_wraps_negative_seed() -> None:
    a = torch.rand(4, generator=make_generator(-1))
    b = torch.rand(4, generator=make_generator(2**64 - 1))
    assert torch.equal(a, b)


N_DRAWS = 4000


def _draw(params: SamplingParams, logits_row: torch.Tensor, **kw) -> list[int]:
    logits = logits_row.unsqueeze(0).expand(N_DRAWS, -1).contiguous()
    return Sampler(seed=7).sample(logits, [params] * N_DRAWS, None, **kw).token_ids


def test_top_k_mask() -> None:
    row = _logits(1, seed=3)[0]
    allowed = set(row.topk(5).indices.tolist())
    drawn = _draw(SamplingParams(temperature=3.0, top_k=5), row)
    assert set(drawn) <= allowed and len(set(drawn)) == 5


def test_top_p_mask() -> None:
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
    row = probs.log()
    # nucleus of 0.7: 0.40 + 0.25 = 0.65 < 0.7, so the smallest set reaching it holds 3 tokens
    drawn = _draw(SamplingParams(top_p=0.7), row)
    assert set(drawn) == {0, 1, 2}
    drawn = _draw(SamplingParams(top_p=0.35), row)
    assert set(drawn) == {0}


def test_top_k_and_top_p_together() -> None:
    row = torch.tensor([0.30, 0.30, 0.20, 0.10, 0.10]).log()
    # top_k=4 renormalises to [.33, .33, .22, .11]; top_p=0.6 then keeps the first two.
    drawn = _draw(SamplingParams(top_k=4, top_p=0.6), row)
    assert set(drawn) == {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -1.0])
    drawn = torch.tensor(_draw(SamplingParams(temperature=temperature), row))
    freq = torch.bincount(drawn, minlength=4).float() / N_DRAWS
    expected = torch.softmax(row / temperature, -1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(4)
    params = [
        SamplingParams(temperature=0.5, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
        SamplingParams(top_k=3, logprobs=20),
    ]
    out = Sampler().sample(logits, params, [None] * 4)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[1] == []
    for i, n in ((0, 5), (3, 20)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == n
        vals, ids = ref[i].topk(n)
        assert [t for t, _ in top] == ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(vals.tolist(), abs=1e-5)


def test_banned_ids_never_sampled() -> None:
    logits = _logits(3)
    argmax = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 3
    out = Sampler().sample(logits, params, None, banned=[[argmax[0]], [], [argmax[2], V + 5]])
    second = logits.topk(2).indices[:, 1].tolist()
    assert out.token_ids == [second[0], argmax[1], second[2]]
    # logprobs still come from the unmodified distribution
    assert out.top_logprobs[0][0][0] == argmax[0]

    row = torch.zeros(8)
    drawn = _draw(SamplingParams(temperature=1.0), row, banned=[[0, 2, 5]] * N_DRAWS)
    assert set(drawn) == {1, 3, 4, 6, 7}


def test_bad_shapes_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(V), [SamplingParams()], None)
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, V), [SamplingParams()], None)


def test_half_precision_input() -> None:
    logits = _logits(4).to(torch.bfloat16)
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 4, None)
    assert out.token_ids == logits.float().argmax(-1).tolist()


@pytest.mark.gpu
def test_cuda_matches_seeded_and_masks() -> None:
    logits = _logits(4).cuda()
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_k=3, seed=1),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=0.8, seed=1, top_k=3),
    ]
    sampler = Sampler()
    out = sampler.sample(
        logits, params, [None, make_generator(1, "cuda"), None, None], [[], [], [], []]
    )
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] in logits[1].topk(3).indices.tolist()
    again = sampler.sample(logits[1:2], params[1:2], [make_generator(1, "cuda")])
    assert again.token_ids[0] == out.token_ids[1]
