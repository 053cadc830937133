"""The draft's distribution at one position and a draw from it, per request of a batch.

Rejection sampling is exact only if the verifier knows the distribution each drafted token
was drawn from, so the draft draws from explicit probabilities: the draft's logits after the
request's temperature, top-k and top-p, the same transforms as the engine's sampler (its
``_top_k_top_p`` is called, not copied: ties with the k-th logit kept, the nucleus the smallest
prefix with mass >= p). Greedy rows take the argmax and get no probabilities (a point mass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams

__all__ = ["draft_probs", "draw"]

# floor of the exponential noise (as the sampler's): probs / q never divides by zero
_TINY = 1e-20


def draft_probs(
    sampler: Sampler, logits: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """(B, V) float32 probabilities of ``logits`` (B, V) after each row's temperature, top-k
    and top-p (rows must not be greedy)."""
    logits = logits.float()
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    logits = logits / temps.to(device, non_blocking=True).unsqueeze(1)
    top_k = [vocab if p.top_k <= 0 else min(p.top_k, vocab) for p in params]
    top_p = [p.top_p for p in params]
    use_k, use_p = any(k < vocab for k in top_k), any(p < 1.0 for p in top_p)
    if use_k or use_p:
        logits = sampler._top_k_top_p(logits, top_k if use_k else None, top_p if use_p else None)
    return torch.softmax(logits, dim=-1)


def draw(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    shared: torch.Generator | None,
) -> torch.Tensor:
    """One token per row of ``probs`` (B, V): an exponential race, argmax(probs / q) with
    q ~ Exp(1), which picks token i with probability probs[i]. Row r's noise comes from
    ``generators[r]``, else from ``shared`` (None: torch's default generator)."""
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_(generator=shared)
    for r, gen in enumerate(generators):
        if gen is not None:
            q[r].exponential_(generator=gen)
    return (probs / q.clamp_min_(_TINY)).argmax(dim=-1)
