"""Speculative decoding through the HTTP server (openai client): a verified row emits several
tokens in one step, and the API still answers as without speculation: the same token ids,
logprobs and text, a stream whose chunks carry several tokens each (with one logprob entry per
token), usage counting every token, and the ``speculative`` opt-out field."""

from __future__ import annotations

from loraplex.engine.spec.proposer import Proposal
from tests.helpers.server import BASE, serve

GREEDY = {"temperature": 0.0}
EXACT = {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
PROMPTS = {BASE: [5, 6, 7, 8, 9], "poem": [30, 31, 32, 33]}
N = 12


class Replay:
    """Proposes what the plain run emitted next (keyed by prompt): every proposal is kept, so
    each verify step emits K + 1 tokens."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference
        self.proposed = 0

    def propose(self, reqs, k):  # type: ignore[no-untyped-def]
        out = []
        for r in reqs:
            ref = self.reference.get(tuple(r.prompt_ids), [])
            toks = ref[len(r.output_ids) : len(r.output_ids) + k]
            self.proposed += len(toks)
            out.append(Proposal(list(toks)))
        return out

    def commit(self, req, num_accepted):  # type: ignore[no-untyped-def]
        pass

    def release(self, req):  # type: ignore[no-untyped-def]
        pass


async def _complete(server, model: str, **kw):  # type: ignore[no-untyped-def]
    return await server.client().completions.create(
        model=model, prompt=PROMPTS[model], max_tokens=N, logprobs=2, extra_body=EXACT,
        **GREEDY, **kw,
    )  # fmt: skip


async def test_speculative_rows_answer_as_plain_ones(tiny) -> None:
    plain = {}
    async for server in serve(tiny):
        for model in PROMPTS:
            plain[model] = (await _complete(server, model)).choices[0]
    reference = {tuple(PROMPTS[m]): c.token_ids for m, c in plain.items()}
    async for server in serve(tiny, speculative_method="ngram", speculative_min_acceptance=0.0):
        replay = Replay(reference)
        server.engine.testing.scheduler.spec.proposer = replay
        for model, ref in plain.items():
            got = (await _complete(server, model)).choices[0]
            assert got.token_ids == ref.token_ids, model
            assert got.text == ref.text
            assert got.logprobs.tokens == ref.logprobs.tokens
            for a, b in zip(got.logprobs.token_logprobs, ref.logprobs.token_logprobs, strict=True):
                assert abs(a - b) < 1e-4

            chunks = [
                c async for c in await _complete(
                    server, model, stream=True, stream_options={"include_usage": True}
                )
            ]  # fmt: skip
            body = [c for c in chunks if c.choices]
            tokens = [t for c in body for t in c.choices[0].token_ids]
            assert tokens == ref.token_ids
            assert len(body) < N  # several tokens per chunk: verify steps kept proposals
            for c in body:
                lp = c.choices[0].logprobs
                assert len(lp.tokens) == len(c.choices[0].token_ids)
            assert "".join(c.choices[0].text for c in body) == ref.text
            assert chunks[-1].usage.completion_tokens == N
        stats = server.engine.stats()["speculative"]
        assert replay.proposed > 0 and stats["accepted_tokens"] == stats["proposed_tokens"]

        before = stats["proposed_tokens"]  # the opt-out: no proposal for this request
        extra = {**EXACT, "speculative": False}
        r = await server.client().completions.create(
            model=BASE, prompt=PROMPTS[BASE], max_tokens=N, extra_body=extra, **GREEDY
        )
        assert r.choices[0].token_ids == plain[BASE].token_ids
        assert server.engine.stats()["speculative"]["proposed_tokens"] == before
