"""Fair seats for requests that fan out: the scheduler's per-group accounting of ``max_num_seqs``.

One API request with ``n`` choices (or several prompts) runs as ``prompts × n`` sibling engine
requests of one group (``Request.group``). Admitted first come first served, one ``n=128``
request filled every seat and a plain request behind it waited until its siblings ended; with
no ``max_tokens`` that was tens of seconds. The policy, while at least two groups have requests
in the queues:

- share = max(1, max_num_seqs // groups): a group's fair number of running sequences;
- admission: requests of groups below their share go first (FIFO among them); requests of
  groups at their share are deferred behind them, not refused: seats nobody else can use
  this step still go to them, so a lone big request keeps every seat (work conserving);
- preemption: a group below its share whose next waiting request could run now (its adapter
  is in a written slot) but finds no free seat takes seats from groups above their share,
  youngest sibling first (recompute preemption, as for KV blocks: the prompt's full blocks
  stay in the prefix cache). Only as many as such requests need: a group at or below its
  share is never preempted for fairness, so single requests behave as before. Waiting on
  siblings to finish instead is not enough: without ``max_tokens`` they hold their seats for
  the whole context length. Preempted siblings come back as soon as seats free up or the
  other groups stop waiting;
- KV preemption prefers a sequence of a group above its share (youngest first) over the
  youngest running one, so a newcomer just admitted is not the first to go when the big
  group's sequences grow.

Counts are kept incrementally (``added``/``left``/``started``/``stopped``, called by the
scheduler), so a decode step pays O(groups) dictionary work and scans the waiting queue only
while some group below its share waits next to one above it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.engine.request import Request

__all__ = ["FairShare"]


class FairShare:
    """Requests per group in the queues and running, and the decisions the policy takes on them."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.members: dict[str, int] = {}  # group -> its requests waiting or running
        self.running: dict[str, int] = {}  # group -> its requests running

    # -- accounting -----------------------------------------------------------------------------

    def added(self, req: Request) -> None:
        """``req`` joined the queues."""
        self.members[req.group] = self.members.get(req.group, 0) + 1

    def left(self, req: Request) -> None:
        """``req`` left the queues for good (finished, aborted, failed)."""
        _dec(self.members, req.group)

    def started(self, req: Request) -> None:
        """``req`` joined the running queue."""
        self.running[req.group] = self.running.get(req.group, 0) + 1

    def stopped(self, req: Request) -> None:
        """``req`` left the running queue (preempted or finished)."""
        _dec(self.running, req.group)

    # -- policy ---------------------------------------------------------------------------------

    def share(self) -> int | None:
        """Running sequences a group may hold while others wait, or None: one group or none
        (no one to be fair to)."""
        groups = len(self.members)
        if groups < 2:
            return None
        return max(1, self.max_num_seqs // groups)

    def full(self, group: str, share: int | None) -> bool:
        """The group holds its share: its waiting requests go behind other groups'."""
        return share is not None and self.running.get(group, 0) >= share

    def victims(
        self,
        running: Sequence[Request],
        waiting: Iterable[Request],
        admissible: Callable[[Request], bool],
    ) -> list[Request]:
        """Running requests to preempt now so that waiting requests of groups below their
        share get a seat (youngest first, from groups above their share); ``admissible``:
        whether a waiting request could be admitted now, seats aside."""
        share = self.share()
        if share is None:
            return []
        run = self.running
        over = {g: k - share for g, k in run.items() if k > share}
        if not over:
            return []
        if not any(k > run.get(g, 0) and run.get(g, 0) < share for g, k in self.members.items()):
            return []  # every group with waiting requests holds its share already
        free = self.max_num_seqs - len(running)
        cap = free + sum(over.values())
        granted: dict[str, int] = {}
        demand = 0
        for r in waiting:
            if demand >= cap:
                break
            g = r.group
            if run.get(g, 0) + granted.get(g, 0) >= share or not admissible(r):
                continue
            granted[g] = granted.get(g, 0) + 1
            demand += 1
        need = demand - free
        out: list[Request] = []
        for r in reversed(running):
            if len(out) >= need:
                break
            if over.get(r.group, 0) > 0:
                over[r.group] -= 1
                out.append(r)
        return out

    def kv_victim(self, queue: Sequence[Request], req: Request) -> int | None:
        """Which running request gives up its KV blocks for ``req``'s next chunk: an index in
        ``queue`` (the running requests not scheduled yet, oldest first), or None for ``req``
        itself. The youngest of a group above its share, else (``req`` not above its share)
        the youngest of ``queue``."""
        share = self.share()
        if share is not None:
            run = self.running
            for i in range(len(queue) - 1, -1, -1):
                if run.get(queue[i].group, 0) > share:
                    return i
            if run.get(req.group, 0) > share:
                return None
        return len(queue) - 1 if queue else None


def _dec(counts: dict[str, int], key: str) -> None:
    k = counts.get(key, 0) - 1
    if k > 0:
        counts[key] = k
    else:
        counts.pop(key, None)
