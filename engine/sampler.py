"""Batched, vectorised token sampling with per-request seeds and raw logprobs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.structured.bitmask import apply_bitmask

__all__ = [
    "HostCopy",
    "PendingSample",
    "Sampler",
    "SamplerOutput",
    "make_generator",
    "min_tokens_banned_ids",
]

_U64 = 2**64
# Floor for the exponential noise so that probs / q never divides by zero.
_TINY = 1e-20


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded with ``seed`` (negative seeds wrap mod 2**64)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed % _U64)
    return gen


def min_tokens_banned_ids(
    params: SamplingParams, num_generated: int, eos_token_ids: Iterable[int]
) -> list[int]:
    """Token ids a row must not sample yet: EOS (unless ``ignore_eos``) and ``stop_token_ids``
    while fewer than ``min_tokens`` tokens were generated; ``[]`` otherwise."""
    if num_generated >= params.min_tokens:
        return []
    ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        ids.update(eos_token_ids)
    return sorted(ids)


@dataclass
class SamplerOutput:
    """Per-row results. ``logprobs`` / ``top_logprobs`` hold None for rows that did not ask."""

    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


class HostCopy:
    """A device tensor's values on their way to the host: the copy (into pinned memory) and
    an event are queued now, so that ``values`` waits for this copy only, not for work queued
    on the stream after it. A CPU tensor is taken as it is."""

    def __init__(self, t: torch.Tensor) -> None:
        self._event = None
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            t = host
        self._t = t

    def values(self) -> list:
        """The values as Python numbers (blocks until the copy is done)."""
        if self._event is not None:
            self._event.synchronize()
        return self._t.tolist()


class PendingSample:
    """A sampled batch whose results are still on the device.

    ``token_ids`` (B,) int64 stays on the device (the next decode step may read it without a
    host round trip). The copy to the host is queued right after sampling, so ``fetch`` waits
    for this step only, not for work queued on the stream after it.
    """

    def __init__(
        self,
        token_ids: torch.Tensor,
        rows: torch.Tensor,
        params: Sequence[SamplingParams],
        want: list[bool] | None,
        n_top: int,
    ) -> None:
        self.token_ids = token_ids
        self._params, self._want, self._n_top = params, want, n_top
        self._rows = HostCopy(rows)

    def fetch(self) -> SamplerOutput:
        """Host results (blocks until this step's sampling is done)."""
        rows = self._rows.values()
        batch = len(self._params)
        if self._want is None:
            return SamplerOutput(rows, [None] * batch, [None] * batch)
        # rows: [token id, top ids..., token logprob, top logprobs...] as float64
        width = 1 + self._n_top
        out = SamplerOutput([int(row[0]) for row in rows])
        for i, p in enumerate(self._params):
            if not self._want[i]:
                out.logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            row, n = rows[i], p.logprobs or 0
            top_ids_i = [int(t) for t in row[1 : 1 + n]]
            out.logprobs.append(row[width])
            out.top_logprobs.append(
                list(zip(top_ids_i, row[width + 1 : width + 1 + n], strict=True))
            )
        return out


class Sampler:
    """Samples one token per row of a (B, V) logits batch.

    Rows may mix greedy and random sampling and differ in temperature / top-p / top-k. A row with
    its own generator draws its noise from it alone, so its tokens do not depend on the other rows
    in the batch. Rows without one share ``default_generator`` (per device; torch's global default
    when the sampler was built without ``seed``).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._defaults: dict[torch.device, torch.Generator] = {}

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        """The shared generator for unseeded rows on ``device`` (None: torch's global one)."""
        if self.seed is None:
            return None
        gen = self._defaults.get(device)
        if gen is None:
            gen = self._defaults[device] = make_generator(self.seed, device)
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
        masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of ``logits`` (B, V); see ``launch``."""
        return self.launch(logits, params, generators, banned, masks).fetch()

    def launch(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
        masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> PendingSample:
        """Queue sampling of one token per row of ``logits`` (B, V); no host sync.

        ``generators[i]`` (optional) is row i's own generator; ``banned[i]`` lists token ids row i
        must not sample (used for ``min_tokens``); ``masks``: (bitmask (R, W) int32, rows (R,))
        on the device, the allowed tokens of constrained rows (``structured/bitmask.py``).
        Logprobs are those of the raw model distribution (log_softmax of the unmodified logits).
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D (batch, vocab), got shape {tuple(logits.shape)}")
        batch, vocab = logits.shape
        if len(params) != batch:
            raise ValueError(f"got {len(params)} SamplingParams for {batch} rows")
        if generators is not None and len(generators) != batch:
            raise ValueError(f"got {len(generators)} generators for {batch} rows")
        if banned is not None and len(banned) != batch:
            raise ValueError(f"got {len(banned)} banned lists for {batch} rows")
        device = logits.device
        logits = logits.float()
        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        logits = self.restrict(logits, banned, masks)

        greedy = [p.greedy for p in params]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self.race(self.probs(logits, params), generators)
            if any(greedy):
                mask = self._to_device(greedy, torch.bool, device)
                token_ids = torch.where(mask, logits.argmax(dim=-1), token_ids)

        if raw_logprobs is None:
            return PendingSample(token_ids, token_ids, params, None, 0)
        return self._gather_logprobs(raw_logprobs, token_ids, params, want_lp)

    # -- pieces ---------------------------------------------------------------------------------

    @staticmethod
    def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Host list -> device tensor without a sync (pinned + non-blocking on CUDA)."""
        t = torch.tensor(values, dtype=dtype)
        if device.type == "cpu":
            return t
        if device.type == "cuda":
            t = t.pin_memory()
        return t.to(device, non_blocking=True)

    def _apply_banned(
        self, logits: torch.Tensor, banned: Sequence[Sequence[int]], vocab: int
    ) -> torch.Tensor:
        flat = [i * vocab + tok for i, ids in enumerate(banned) for tok in ids if 0 <= tok < vocab]
        if not flat:
            return logits
        # index_fill_ on the flat view: unlike logits[rows, cols] = x it does not sync on CUDA.
        logits = logits.contiguous().clone()
        index = self._to_device(flat, torch.long, logits.device)
        logits.view(-1).index_fill_(0, index, float("-inf"))
        return logits

    def restrict(
        self,
        logits: torch.Tensor,
        banned: Sequence[Sequence[int]] | None = None,
        masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Float (B, V) ``logits`` with what rows may not sample at -inf: the structured-output
        bitmasks (``masks``) and the ``banned`` ids (``min_tokens``). May write ``logits`` in
        place (callers keep the raw logprobs apart). The greedy rows' argmax reads this."""
        if masks is not None:
            logits = logits.contiguous()
            apply_bitmask(logits, *masks)  # in place: raw logprobs are a new tensor
        if banned is not None and any(banned):
            logits = self._apply_banned(logits, banned, logits.shape[1])
        return logits

    def probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution each sampled row draws from: ``restrict``-ed ``logits`` (B, V)
        through temperature, top-k and top-p, softmaxed (greedy rows: plain softmax, unused).
        Speculative verification (spec/verify.py) reads the same."""
        device = logits.device
        vocab = logits.shape[1]
        temps = [1.0 if p.greedy else p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / self._to_device(temps, torch.float32, device).unsqueeze(1)
        top_k = [vocab if p.greedy or p.top_k <= 0 else min(p.top_k, vocab) for p in params]
        top_p = [1.0 if p.greedy else p.top_p for p in params]
        use_k, use_p = any(k < vocab for k in top_k), any(p < 1.0 for p in top_p)
        if use_k or use_p:
            logits = self._top_k_top_p(logits, top_k if use_k else None, top_p if use_p else None)
        return torch.softmax(logits, dim=-1)

    def race(
        self,
        probs: torch.Tensor,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """One draw per row of ``probs`` (B, V) (unnormalised weights are fine): an exponential
        race, argmax(probs / q) with q ~ Exp(1) from row i's own generator, or one shared draw
        for the rows without (``default_generator``). Divides ``probs`` in place."""
        device = probs.device
        q = torch.empty_like(probs)
        own = [None] * probs.shape[0] if generators is None else list(generators)
        shared_rows = [i for i, g in enumerate(own) if g is None]
        if shared_rows:
            # One draw for all unseeded rows (over-draws for seeded ones, which are overwritten).
            q.exponential_(generator=self.default_generator(device))
        for i, gen in enumerate(own):
            if gen is not None:
                q[i].exponential_(generator=gen)
        q.clamp_min_(_TINY)
        return probs.div_(q).argmax(dim=-1)

    def _top_k_top_p(
        self, logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None
    ) -> torch.Tensor:
        """Mask logits outside each row's top-k and nucleus (smallest prefix with mass >= p)."""
        device = logits.device
        ninf = float("-inf")
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if top_k is not None:
            k = self._to_device(top_k, torch.long, device).unsqueeze(1)
            kth = sorted_logits.gather(1, k - 1)
            # Ties with the k-th value are kept.
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, ninf)
        if top_p is not None:
            # Rows at p = 1 get a threshold above any reachable cumulative mass.
            p = self._to_device([x if x < 1.0 else 2.0 for x in top_p], torch.float32, device)
            probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = mass_before >= p.unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, ninf)
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    def _gather_logprobs(
        self,
        raw: torch.Tensor,
        token_ids: torch.Tensor,
        params: Sequence[SamplingParams],
        want: list[bool],
    ) -> PendingSample:
        ids = token_ids.unsqueeze(1)
        vals = raw.gather(1, ids)
        n_top = min(max((p.logprobs or 0) for p in params), raw.shape[1])
        if n_top > 0:
            top_vals, top_ids = raw.topk(n_top, dim=-1)
            ids, vals = torch.cat([ids, top_ids], dim=1), torch.cat([vals, top_vals], dim=1)
        # One device->host transfer: ids (< 2**53) are exact in float64.
        rows = torch.cat([ids.double(), vals.double()], dim=1)
        return PendingSample(token_ids, rows, params, want, n_top)
