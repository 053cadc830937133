"""Per-request acceptance and backoff: a request is proposed for only while proposals pay.

A verify step of K proposed tokens costs ``c`` decode steps (``c`` a little above 1 on a GPU at
small batch: the step is memory bound; ``benchmarks/spec_decode.py`` measures it) and emits
``1 + L`` tokens, ``L`` the accepted prefix. With a per-position acceptance ``a`` (each proposed
token kept with probability ``a`` given the ones before it were) the expected tokens per verify
step are ``(1 - a^(K+1)) / (1 - a)``, so speculation pays for a request while that exceeds
``c``. At K = 4: c = 1.1 needs a >= 0.09, c = 1.25 (the verify-step cost the project aims at)
a >= 0.2, c = 1.5 a >= 0.4. The default threshold ``speculative_min_acceptance`` = 0.2 is the
break-even at c = 1.25; a device whose verify steps cost more (a CPU: several decode steps)
wants a higher one.

Estimate: ``a`` of one request from its recent verify steps. A step with ``L`` of ``n`` proposed
tokens accepted tested ``L + 1`` positions (every accepted one and the first rejected; ``L``
when all were accepted) and passed ``L``: the positions after the first rejection say nothing.
The estimate is ``S / T``, the accepted and tested positions each summed with weight 1/2 per
verify step back (the latest step weighs as much as all earlier ones together), so a request
that stopped quoting is caught within a few steps and one that quotes does not stop at its
first miss.

Rule, after each verify step of a request:

- ``S / T >= min_acceptance``: keep proposing; the backoff is reset;
- below: no proposals for the next ``skip`` decode tokens of the request, ``skip`` starting at
  ``BACKOFF_FIRST`` and doubling on each consecutive backoff up to ``BACKOFF_MAX``; the estimate
  is cleared, so the first verify step after the backoff (a probe) decides alone. A request
  whose output starts quoting later is back to proposals after its next probe.

Skips count the request's tokens (``Request.num_tokens``), not steps, so they hold whatever
path decodes them (pipelined steps included: a request whose backoff covers its next token
does not keep the scheduler from chaining). ``min_acceptance`` 0 turns the rule off. State is
one small record per request that was verified, dropped on ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.request import Request

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "DECAY", "Backoff"]

BACKOFF_FIRST = 4  # tokens decoded without proposals after a first failing verify step
BACKOFF_MAX = 64  # the doubling stops here (a probe every 64 tokens costs < 1 % at c = 1.25)
DECAY = 0.5  # weight of a verify step one step older in the acceptance estimate


@dataclass
class _Track:
    accepted: float = 0.0  # S: decayed accepted positions
    tested: float = 0.0  # T: decayed tested positions
    failures: int = 0  # consecutive backoffs
    resume_at: int = 0  # proposals again once the request holds this many tokens


class Backoff:
    """The per-request rule of the module docstring (keyed by ``request_id``)."""

    def __init__(self, min_acceptance: float) -> None:
        self.min_acceptance = min_acceptance
        self._tracks: dict[str, _Track] = {}

    def __len__(self) -> int:
        """Requests with state (tests: nothing left after release)."""
        return len(self._tracks)

    def allows(self, req: Request, ahead: int = 0) -> bool:
        """Whether ``req`` gets a proposal once it holds ``num_tokens + ahead`` tokens
        (``ahead`` 1: at the step after one in flight that samples its next token)."""
        track = self._tracks.get(req.request_id)
        return track is None or req.num_tokens + ahead >= track.resume_at

    def estimate(self, req: Request) -> float | None:
        """The request's per-position acceptance estimate ``S / T`` (None: no verify step
        counted since it started or last backed off)."""
        track = self._tracks.get(req.request_id)
        if track is None or track.tested <= 0:
            return None
        return track.accepted / track.tested

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        """After a verify step of ``req`` (its emitted tokens already appended): update the
        estimate, back off when it is below the threshold."""
        if self.min_acceptance <= 0 or proposed <= 0:
            return
        track = self._tracks.setdefault(req.request_id, _Track())
        track.accepted = DECAY * track.accepted + accepted
        track.tested = DECAY * track.tested + accepted + (1 if accepted < proposed else 0)
        if track.accepted >= self.min_acceptance * track.tested:
            track.failures = 0
            return
        skip = min(BACKOFF_FIRST << track.failures, BACKOFF_MAX)
        track.failures += 1
        track.resume_at = req.num_tokens + skip
        track.accepted = track.tested = 0.0

    def release(self, req: Request) -> None:
        self._tracks.pop(req.request_id, None)
