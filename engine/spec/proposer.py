"""What a proposer gives the verifier, and what the verifier tells it back.

A proposer looks at running requests (prompt + output so far) and proposes up to ``k`` next
tokens for each. The verifier runs each row as a ``1 + len(tokens)``-token row of the normal
step (the request's own adapter on every position), accepts a prefix of the proposal by
rejection sampling against the target's distribution and appends one more token of its own
(the correction on a rejection, the bonus token when all were accepted).

Exactness needs the proposal's distribution: ``probs`` row ``i`` is the distribution the
proposer drew ``tokens[i]`` from, after the request's sampling transforms (temperature, top-k,
top-p). A deterministic proposer (prompt lookup) leaves ``probs`` as ``None``: its proposal is a
point mass, the acceptance probability of token ``x`` is the target's ``p(x)`` and a rejection
resamples from ``p`` with ``x`` removed.

A proposer whose class sets ``runs_model = True`` (the draft model) is called in the engine's
step thread before a step is scheduled, never on the event loop (spec/control.py); its
``release`` may then come from the event loop while it proposes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from loraplex.engine.request import Request

__all__ = ["Proposal", "Proposer"]


@dataclass
class Proposal:
    """Up to ``k`` proposed token ids for one request; empty: no proposal this step."""

    tokens: list[int] = field(default_factory=list)
    # (len(tokens), vocab) float32 on any device: the proposer's distribution at each position;
    # None: each token is a point mass (deterministic proposer)
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """The proposer side of speculative decoding (one instance per engine)."""

    def propose(self, reqs: Sequence[Request], k: int) -> list[Proposal]:
        """One proposal per request, in order, each at most ``k`` tokens."""
        ...

    def commit(self, req: Request, num_accepted: int) -> None:
        """After verification: ``num_accepted`` of the request's last proposal were kept and
        the verifier appended its own token to ``req.output_ids``. A proposer with state of its
        own (a draft model's KV) rolls back past the rejected positions here."""
        ...

    def release(self, req: Request) -> None:
        """The request finished, was aborted or preempted: drop any state kept for it."""
        ...
