"""When and how much to speculate: the engine's side of a proposer, and what it counts.

``Speculation`` (one per engine, built by ``from_config``; None when speculation is off) is
asked by the scheduler for the proposals of a step's decoding rows and told by the core what
verification kept. Rules:

- a step speculates only while at most ``speculative_max_running`` requests run: a small
  decode batch is memory bound (K more tokens per row cost little), a large one is not;
- a request that opted out (``SamplingParams.speculative`` False) gets no proposal;
- a request whose recent proposals were mostly rejected gets none for a while (backoff.py:
  per-request acceptance estimate against ``speculative_min_acceptance``, doubling backoff),
  so speculation pays for itself per request, hence per adapter;
- a proposer that runs a model (``runs_model``: the draft model) is never run while
  scheduling, on the event loop: the step loop first has it propose in the step thread
  (``asking`` then ``propose_ahead``; no step is in flight then, as speculative steps are not
  pipelined) and ``propose`` hands out what it proposed for requests whose tokens are still
  the same; a cheap one (prompt lookup) proposes inline;
- a proposal is cut so that everything the row may emit fits ``max_tokens`` and the model
  length, and, for a structured-output request, at the first token its grammar refuses
  (llguidance ``validate_tokens``: a refused token could never be kept, and the masks of the
  positions after it could not be computed).

Counters (``stats``, the Prometheus families of metrics.py): tokens proposed and accepted,
verified rows by acceptance length and decoding rows left without a proposal by the backoff,
each per adapter name ("" for the base model).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import SpeculativeConfigError
from loraplex.engine.request import Request
from loraplex.engine.spec.backoff import Backoff
from loraplex.engine.spec.ngram import NgramProposer
from loraplex.engine.spec.proposer import Proposal, Proposer

__all__ = ["Speculation"]


class Speculation:
    """A proposer with the engine's limits, and the acceptance counters."""

    def __init__(
        self,
        proposer: Proposer,
        k: int,
        max_running: int,
        max_model_len: int,
        min_acceptance: float = 0.0,
    ) -> None:
        self.proposer = proposer
        self.k = k
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.backoff = Backoff(min_acceptance)  # per request: proposals only while they pay
        # decoding rows not proposed for because their request was backing off, per adapter
        self.skipped: defaultdict[str, int] = defaultdict(int)
        self.proposed: defaultdict[str, int] = defaultdict(int)  # tokens, per adapter
        self.accepted: defaultdict[str, int] = defaultdict(int)
        # verified rows per adapter by accepted length: hist[adapter][a], a in 0..k
        self.hist: defaultdict[str, list[int]] = defaultdict(lambda: [0] * (k + 1))
        # proposals made ahead (step thread): id(req) -> (its num_tokens then, proposal)
        self._ahead: dict[int, tuple[int, Proposal]] = {}

    @classmethod
    def from_config(
        cls, config: EngineConfig, max_model_len: int, proposer: Proposer | None = None
    ) -> Speculation | None:
        """The engine's speculation (None: off). ``EngineConfig`` checked the combinations.
        ``proposer``: the one start-up built (the draft model, ``draft_start.load_draft``: it
        needs the target's tokenizer and its share of the KV budget); "ngram" needs none."""
        method = config.speculative_method
        if method is None:
            return None
        if proposer is None and method == "ngram":
            proposer = NgramProposer(config.speculative_ngram_max, config.speculative_ngram_min)
        if proposer is None:
            raise SpeculativeConfigError(
                f"speculative_method {method!r}: its proposer is built at start-up "
                "(startup.build_core loads the draft model); none was given",
                field="speculative_method",
            )
        k, most = config.num_speculative_tokens, config.speculative_max_running
        return cls(proposer, k, most, max_model_len, config.speculative_min_acceptance)

    def active(self, running: int) -> bool:
        """Whether a step with ``running`` requests running speculates."""
        return running <= self.max_running

    @property
    def ahead(self) -> bool:
        """Whether the proposer runs ahead of scheduling, in the step thread (it runs a
        model: ``runs_model``)."""
        return bool(getattr(self.proposer, "runs_model", False))

    def wants(self, req: Request, ahead: int = 0) -> bool:
        """Whether ``req`` (decoding) is proposed for once it holds ``ahead`` more tokens: it
        did not opt out and is not backing off (backoff.py)."""
        return req.params.speculative and self.backoff.allows(req, ahead)

    def wanted_after(self, running: Sequence[Request]) -> bool:
        """Whether the step after one in flight (each of ``running`` one token further) would
        propose for any of them: if not, it may be chained (pipelined) like a plain decode."""
        return self.active(len(running)) and any(self.wants(r, 1) for r in running)

    def asking(self, running: Sequence[Request]) -> list[Request]:
        """The requests of ``running`` a step proposes for: decoding ones that did not opt
        out and are not backing off, while the step speculates."""
        if not self.active(len(running)):
            return []
        return [r for r in running if r.num_computed == r.num_tokens - 1 and self.wants(r)]

    def count_backoff(self, reqs: Sequence[Request], ahead: int = 0) -> None:
        """Count the decoding rows of ``reqs`` (each ``ahead`` tokens further) that go without a
        proposal because their request backs off (``backoff_rows``, per adapter)."""
        for r in reqs:
            if r.params.speculative and not self.backoff.allows(r, ahead):
                self.skipped[r.adapter.name if r.adapter is not None else ""] += 1

    def propose_ahead(self, reqs: Sequence[Request]) -> None:
        """Step thread, before the step is scheduled: the proposer's proposals for ``reqs``
        (``asking``), kept for the next ``propose``."""
        props = self.proposer.propose(reqs, self.k)
        self._ahead = {id(r): (r.num_tokens, p) for r, p in zip(reqs, props, strict=True)}

    def propose(self, reqs: Sequence[Request]) -> dict[int, Proposal]:
        """Proposals of decoding ``reqs`` (keyed by ``id(req)``; those without one left out),
        each cut to the limits in the module docstring. A proposer that runs ahead is not
        called: its proposals made ahead are taken (a request without one gets none)."""
        self.count_backoff(reqs)
        asking = [r for r in reqs if self.wants(r)]
        ahead, self._ahead = self._ahead, {}
        if not asking:
            return {}
        if self.ahead:
            props = []
            for r in asking:  # (a request's tokens changed since: no proposal)
                n, prop = ahead.get(id(r), (-1, Proposal()))
                props.append(prop if n == r.num_tokens else Proposal())
        else:
            props = self.proposer.propose(asking, self.k)
        out = {}
        for req, prop in zip(asking, props, strict=True):
            n = min(
                len(prop.tokens),
                self.k,
                # every emitted token (the kept ones and one more) within max_tokens / length
                req.params.max_tokens - len(req.output_ids) - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            guide = req.guide
            if n > 0 and guide is not None:
                m = guide.matcher
                n = 0 if m.is_stopped() or m.is_error() else m.validate_tokens(prop.tokens[:n])
            if n <= 0:
                continue
            probs = prop.probs[:n] if prop.probs is not None else None
            out[id(req)] = Proposal(list(prop.tokens[:n]), probs)
        return out

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        """After a verification row of ``req``: count it, update its backoff and tell the
        proposer."""
        name = req.adapter.name if req.adapter is not None else ""
        self.proposed[name] += proposed
        self.accepted[name] += accepted
        self.hist[name][accepted] += 1
        self.backoff.verified(req, proposed, accepted)
        self.proposer.commit(req, accepted)

    def release(self, req: Request) -> None:
        self.backoff.release(req)
        self.proposer.release(req)

    def stats(self) -> dict[str, Any]:
        """Totals and per-adapter counters (engine stats: ``speculative``)."""
        names = sorted(set(self.hist) | set(self.skipped))
        proposed = sum(self.proposed.values())
        accepted = sum(self.accepted.values())
        return {
            "k": self.k,
            "proposed_tokens": proposed,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "min_acceptance": self.backoff.min_acceptance,
            "per_adapter": {
                n: {
                    "proposed_tokens": self.proposed[n],
                    "accepted_tokens": self.accepted[n],
                    "acceptance_lengths": list(self.hist[n]),
                    "backoff_rows": self.skipped.get(n, 0),
                }
                for n in names
            },
        }
