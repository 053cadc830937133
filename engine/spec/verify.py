"""Verification of proposals: which proposed tokens a row keeps, and the one token it adds.

A row with proposal ``d_1 .. d_k`` ran as ``k + 1`` positions of the step; the logits at
position ``j`` are the target's distribution of the token after ``d_1 .. d_j``. Every sampling
transform the engine's sampler applies (``Sampler.restrict``: structured-output bitmasks and
``min_tokens`` bans, both per position; ``Sampler.probs``: temperature, top-k, top-p) is
applied to every position by the sampler's own code, so ``p`` below is exactly what the row
would sample from without speculation.

- greedy rows keep ``d_j`` while it is the argmax of position ``j - 1``; the first mismatch
  is replaced by that argmax;
- sampled rows: standard speculative rejection sampling. ``d_j`` is kept with probability
  ``min(1, p(d_j) / q(d_j))`` (``q``: the proposer's distribution, a point mass at ``d_j``
  when ``Proposal.probs`` is None); the first rejected one is replaced by a draw from
  ``norm(max(p - q, 0))``. The emitted tokens are then distributed exactly as ``p``.
- a row whose every proposed token was kept adds a draw from ``p`` at position ``k`` (the
  bonus token). A row without a proposal is that case with ``k = 0``: a normal sample.

All randomness of a row comes from its own generator (``Request.generator``) or, for unseeded
rows, the sampler's shared one; every draw a row might need is made up front on the device
(uniforms for the acceptance tests, exponential races for corrections and the bonus), and
the results cross to the host in one copy. Logprobs are those of the raw logits at the
position of each emitted token, as the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraplex.engine.sampler import HostCopy, Sampler
from loraplex.engine.sampling_params import SamplingParams

__all__ = ["PendingGreedy", "PendingVerify", "VerifyOutput", "VerifyRow", "verify"]

_TINY = 1e-20


@dataclass
class VerifyRow:
    """One row of a verification step: ``1 + len(draft)`` logits positions."""

    params: SamplingParams
    generator: torch.Generator | None
    draft: list[int]
    # (len(draft), V) the proposer's distribution of each draft token; None: point masses
    draft_probs: torch.Tensor | None = None
    # per position (1 + len(draft) lists): ids the position must not sample (min_tokens)
    banned: list[list[int]] = field(default_factory=list)


@dataclass
class VerifyOutput:
    """Per row: the tokens it emits (kept proposal tokens, then its own), their raw logprobs
    and top logprobs (None where the row asked for none), and how many proposed were kept."""

    tokens: list[list[int]]
    logprobs: list[list[float | None]]
    top_logprobs: list[list[list[tuple[int, float]] | None]]
    accepted: list[int]


class PendingVerify:
    """A verification whose results are still on the device (``fetch`` copies them once)."""

    def __init__(self, rows: Sequence[VerifyRow], flat: torch.Tensor, n_top: int) -> None:
        self.rows = rows
        self.n_top = n_top
        self._flat = HostCopy(flat)

    def fetch(self) -> VerifyOutput:
        vals = self._flat.values()
        rows = self.rows
        d = sum(len(r.draft) for r in rows)
        b = len(rows)
        n = d + b
        # layout (verify): accept[D], corr[D], bonus[B], lp_draft[D], lp_corr[D], lp_bonus[B],
        # then top ids [N * n_top] and top logprobs [N * n_top] by position
        accept, corr, bonus = vals[:d], vals[d : 2 * d], vals[2 * d : 2 * d + b]
        o = 2 * d + b
        lp_draft, lp_corr, lp_bonus = vals[o : o + d], vals[o + d : o + 2 * d], vals[o + 2 * d :]
        lp_bonus = lp_bonus[:b]
        o += 2 * d + b
        nt = self.n_top
        top_ids, top_lps = vals[o : o + n * nt], vals[o + n * nt : o + 2 * n * nt]
        out = VerifyOutput([], [], [], [])
        di = pos = 0
        for i, r in enumerate(rows):
            k = len(r.draft)
            a = 0
            while a < k and accept[di + a] > 0.5:
                a += 1
            toks = list(r.draft[:a])
            lps: list[float | None] = list(lp_draft[di : di + a])
            if a < k:
                toks.append(int(corr[di + a]))
                lps.append(lp_corr[di + a])
            else:
                toks.append(int(bonus[i]))
                lps.append(lp_bonus[i])
            want = r.params.logprobs
            tops: list[list[tuple[int, float]] | None] = []
            for j in range(len(toks)):
                if want is None:
                    tops.append(None)
                    continue
                s = (pos + j) * nt
                ids, lps_top = top_ids[s : s + want], top_lps[s : s + want]
                tops.append([(int(t), v) for t, v in zip(ids, lps_top, strict=True)])
            out.tokens.append(toks)
            out.logprobs.append(lps if want is not None else [None] * len(toks))
            out.top_logprobs.append(tops)
            out.accepted.append(a)
            di += k
            pos += k + 1
        return out


class PendingGreedy:
    """A verification of greedy rows that ask for no logprobs and have nothing restricted
    (no structured-output mask, no ``min_tokens`` ban): only each position's argmax crosses to
    the host, and the kept prefix is found there. The tokens are ``verify``'s general path's
    (a draft token is kept while it is the argmax of the position before it; the first that
    is not is replaced by that argmax, and a row whose every draft token was kept adds the
    argmax of its last position) in two device ops and one copy instead of ~18 (the
    verification runs between two graph replays, on the step's critical path)."""

    def __init__(self, rows: Sequence[VerifyRow], argmax: torch.Tensor) -> None:
        self.rows = rows
        self._argmax = HostCopy(argmax)

    def fetch(self) -> VerifyOutput:
        am = self._argmax.values()
        out = VerifyOutput([], [], [], [])
        pos = 0
        for r in self.rows:
            k, draft = len(r.draft), r.draft
            a = 0
            while a < k and draft[a] == am[pos + a]:
                a += 1
            toks = [*draft[:a], am[pos + a]]  # the correction, or the bonus (a == k)
            out.tokens.append(toks)
            out.logprobs.append([None] * len(toks))
            out.top_logprobs.append([None] * len(toks))
            out.accepted.append(a)
            pos += k + 1
        return out


def _plain_greedy(
    rows: Sequence[VerifyRow], masks: tuple[torch.Tensor, torch.Tensor] | None
) -> bool:
    """Every row greedy, without logprobs, bans or masks: ``PendingGreedy`` verifies it."""
    return masks is None and all(
        r.params.greedy and r.params.logprobs is None and not any(r.banned) for r in rows
    )


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return Sampler._to_device(values, dtype, device)


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: Sequence[VerifyRow],
    masks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PendingVerify | PendingGreedy:
    """Queue the verification of ``rows`` against ``logits`` ((sum of 1 + len(draft), V), the
    positions of each row in order); ``masks``: (bitmask (R, W), positions (R,)) of the
    constrained positions (``structured/bitmask.py``). No host sync (``fetch`` waits)."""
    device = logits.device
    n = sum(1 + len(r.draft) for r in rows)
    if logits.dim() != 2 or logits.shape[0] != n:
        raise ValueError(f"expected ({n}, vocab) logits for these rows, got {tuple(logits.shape)}")
    if _plain_greedy(rows, masks):
        # (in float32, as the general path: on the CPU a bfloat16 argmax is ~2 x slower)
        return PendingGreedy(rows, logits.float().argmax(dim=-1))
    params: list[SamplingParams] = []
    banned: list[list[int]] = []
    gens: list[torch.Generator | None] = []  # per position
    dpos: list[int] = []  # the position whose distribution judges each draft token
    dtok: list[int] = []
    last: list[int] = []
    pos = 0
    for r in rows:
        k = len(r.draft)
        params += [r.params] * (k + 1)
        banned += r.banned or [[] for _ in range(k + 1)]
        gens += [r.generator] * (k + 1)
        dpos += range(pos, pos + k)
        dtok += r.draft
        last.append(pos + k)
        pos += k + 1
    logits = logits.float()
    want_lp = any(r.params.logprobs is not None for r in rows)
    raw = torch.log_softmax(logits, dim=-1) if want_lp else None  # (before any mask)
    p_logits = sampler.restrict(logits, banned, masks)
    vocab = p_logits.shape[1]
    dpos_t, dtok_t, last_t = (_to(x, torch.long, device) for x in (dpos, dtok, last))
    argmax = p_logits.argmax(dim=-1)  # (N,): the greedy rows' choice at every position
    am_d, am_last = argmax.index_select(0, dpos_t), argmax.index_select(0, last_t)
    greedy_rows = [r.params.greedy for r in rows]
    if all(greedy_rows):
        accept, corr, bonus = am_d == dtok_t, am_d, am_last
    else:
        accept, corr, bonus = _rejection(
            sampler, sampler.probs(p_logits, params), rows, [gens[i] for i in dpos],
            (dpos_t, dtok_t, last_t), greedy_rows, am_d, am_last,
        )  # fmt: skip
    d = len(dtok)
    if raw is not None:
        lp_draft = raw[dpos_t, dtok_t] if d else raw.new_zeros(0)
        lp_corr = raw[dpos_t, corr] if d else raw.new_zeros(0)
        lp_bonus = raw[last_t, bonus]
    else:
        lp_draft = lp_corr = logits.new_zeros(d)
        lp_bonus = logits.new_zeros(len(rows))
    n_top = min(max((r.params.logprobs or 0) for r in rows), vocab)
    parts = [accept.double(), corr.double(), bonus.double(), lp_draft.double(),
             lp_corr.double(), lp_bonus.double()]  # fmt: skip
    if n_top > 0:
        assert raw is not None
        top_vals, top_ids = raw.topk(n_top, dim=-1)
        parts += [top_ids.double().flatten(), top_vals.double().flatten()]
    return PendingVerify(rows, torch.cat(parts), n_top)


def _rejection(
    sampler: Sampler,
    probs: torch.Tensor,
    rows: Sequence[VerifyRow],
    dgens: list[torch.Generator | None],
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    greedy_rows: list[bool],
    am_d: torch.Tensor,
    am_last: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step with sampled rows: (accept (D,) bool, correction (D,), bonus (B,)) from the
    target's ``probs`` (N, V); greedy rows take the argmax (``am_*``)."""
    dpos_t, dtok_t, last_t = index
    device, vocab, d = probs.device, probs.shape[1], dtok_t.shape[0]
    # the proposal's distribution at each draft position: (D, V)
    q = torch.zeros((d, vocab), dtype=torch.float32, device=device)
    if d:
        q.scatter_(1, dtok_t.unsqueeze(1), 1.0)
        j = 0
        for r in rows:
            k = len(r.draft)
            if k and r.draft_probs is not None:
                # a draft's distribution may be narrower than the logits (a draft model has the
                # base vocabulary, an adapter may add tokens): the ids past it have q = 0
                w = r.draft_probs.shape[1]
                if w > vocab:
                    raise ValueError(f"a proposal's distribution has {w} ids, the logits {vocab}")
                q[j : j + k, :w] = r.draft_probs.to(device=device, dtype=torch.float32)
            j += k
    p_draft = probs.index_select(0, dpos_t)  # (D, V)
    p_d = p_draft.gather(1, dtok_t.unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, dtok_t.unsqueeze(1)).squeeze(1).clamp_min(_TINY)
    # uniforms of the acceptance tests, each row from its own generator
    u = torch.empty(d, dtype=torch.float32, device=device)
    if any(g is None for g in dgens):
        u.uniform_(generator=sampler.default_generator(device))
    j = 0
    for r in rows:
        k = len(r.draft)
        if k and r.generator is not None:
            u[j : j + k] = torch.rand(k, generator=r.generator, device=device)
        j += k
    greedy_d = _to(
        [greedy_rows[i] for i, r in enumerate(rows) for _ in r.draft], torch.bool, device
    )
    accept = torch.where(greedy_d, am_d == dtok_t, u * q_d < p_d)
    # corrections (residual draws) and bonus draws in one race, each row's noise its own
    residual = (p_draft - q).clamp_min_(0.0)
    racing = torch.cat([residual, probs.index_select(0, last_t)])
    drawn = sampler.race(racing, dgens + [r.generator for r in rows])
    greedy_all = torch.cat([greedy_d, _to(greedy_rows, torch.bool, device)])
    drawn = torch.where(greedy_all, torch.cat([am_d, am_last]), drawn)
    return accept, drawn[:d], drawn[d:]
