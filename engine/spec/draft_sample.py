"""The draft's distribution at one position, per request of a batch.

Rejection sampling is exact only if the verifier knows the distribution each drafted token
was drawn from, so the draft draws from explicit probabilities: the draft's logits after the
request's temperature, top-k and top-p, through the engine sampler's own ``Sampler.probs``
(the verifier reads the target's distribution through it too: one implementation of the
transforms, ties with the k-th logit kept, the nucleus the smallest prefix with mass >= p).
The draws are the sampler's ``race``. Greedy rows take the argmax and get no probabilities (a
point mass).

The draft's vocabulary is the target's base vocabulary; the target's logits may be wider (an
adapter's added tokens, ``lora_extra_vocab_size``): the verifier reads the ids past the draft's
as probability 0 (``verify._rejection``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams

__all__ = ["draft_probs"]


def draft_probs(
    sampler: Sampler, logits: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """(B, V) float32 probabilities of ``logits`` (B, V) after each row's temperature, top-k
    and top-p (rows must not be greedy)."""
    if any(p.greedy for p in params):
        raise ValueError("draft_probs: greedy rows have no distribution (a point mass)")
    return sampler.probs(logits.float(), params)
