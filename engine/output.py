"""Turn a sampled token into a streamed RequestOutput: stop checks, text, logprobs."""

from __future__ import annotations

from loraplex.engine.request import Request, RequestOutput, TokenLogprob

__all__ = ["append_token", "append_tokens", "final_output", "merge_outputs"]


def append_token(
    req: Request,
    token: int,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    max_model_len: int,
) -> RequestOutput:
    """Append ``token`` to ``req`` and decide whether it finished (sets req.finish_reason)."""
    p = req.params
    req.output_ids.append(token)
    text = ""
    reason: str | None = None
    if token in req.eos_ids and not p.ignore_eos:
        reason = "stop"
    elif p.stop_token_ids and token in p.stop_token_ids:
        reason, req.stop_reason = "stop", token
    else:
        if req.detok is not None:
            text = req.detok.step([token])
            if req.detok.stopped:
                reason, req.stop_reason = "stop", req.detok.stop_reason
    if reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens >= max_model_len):
        reason = "length"
    if reason is not None and req.stop_reason is None and req.detok is not None:
        text += req.detok.flush()
    req.finish_reason = reason
    lps = None
    if p.logprobs is not None and logprob is not None:
        lps = [TokenLogprob(token, logprob, top or [])]
    return RequestOutput(
        request_id=req.request_id,
        token_ids=[token],
        text=text,
        finished=reason is not None,
        finish_reason=reason,
        logprobs=lps,
        num_prompt_tokens=len(req.prompt_ids),
        num_output_tokens=len(req.output_ids),
        num_cached_tokens=req.num_cached,
        stop_reason=req.stop_reason,
    )


def final_output(req: Request, reason: str, error: BaseException | None = None) -> RequestOutput:
    """The closing chunk of a request that ends outside the normal token path.

    NOTE: text held back for stop-string matching is dropped on abort, as in vLLM.
    """
    return RequestOutput(
        request_id=req.request_id,
        token_ids=[],
        text="",
        finished=True,
        finish_reason=reason,
        num_prompt_tokens=len(req.prompt_ids),
        num_output_tokens=len(req.output_ids),
        num_cached_tokens=req.num_cached,
        error=error,
    )


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """One streamed chunk of several tokens appended in one step (speculative decoding):
    their tokens, text and logprobs in order; finish fields and counts of the last."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    lps = [lp for o in outs for lp in o.logprobs or []]
    return RequestOutput(
        request_id=last.request_id,
        token_ids=[t for o in outs for t in o.token_ids],
        text="".join(o.text for o in outs),
        finished=last.finished,
        finish_reason=last.finish_reason,
        logprobs=lps if any(o.logprobs is not None for o in outs) else None,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        stop_reason=last.stop_reason,
    )


def append_tokens(
    req: Request,
    tokens: list[int],
    logprobs: list[float | None],
    tops: list[list[tuple[int, float]] | None],
    max_model_len: int,
    now: float,
) -> tuple[RequestOutput, int]:
    """Append a verified row's tokens one by one until one finishes ``req`` (stop token or
    string, ``max_tokens``, model length: the rest are dropped, as they would never have been
    sampled); returns the one streamed chunk and how many were appended."""
    outs = []
    for tok, lp, top in zip(tokens, logprobs, tops, strict=True):
        outs.append(append_token(req, tok, lp, top, max_model_len))
        req.token_times.append(now)
        if outs[-1].finished:
            break
    return merge_outputs(outs), len(outs)
