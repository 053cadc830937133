"""Rank 0's model runner of a tensor-parallel engine: each step and slot write sent once to the
workers, which replay it on their shards (worker.py).

The executor drives it as any ``ModelRunner``: ``execute(items, feed)`` sends the step's items
(token ids, positions and block tables; slot of each row) with the slot -> rank table, then
runs rank 0's own shard; the collectives inside the forward keep the ranks in step. A
pipelined step's feed (the previous step's sampled ids, on rank 0 only) goes to the workers by
one broadcast. Sampling needs nothing from the workers: the vocab-parallel LM head gathers the
logits on every rank.

Slot writes: the loader stages each adapter whole (full-model layout, the CPU tier); when its
load ends, every rank's shard (``tp.shard_adapter``) is packed once, off the step thread
(``prepare_adapter``, called by the core; kept on the adapter as ``shard_images``). A slot
write sends each worker its packed shard as one raw buffer with the slot store's decisions,
in order with the steps, and writes rank 0's. Writes are synchronous on the compute stream
(no side stream under TP yet: the slot store's inline writer).

Any exception in a step fails the group (``WorkerGroup.failure``): after a collective broke
the ranks cannot be brought back in step, so every later step raises the same typed error.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from loraplex.engine.model.lora.slot_image import PackedAdapter, pack_adapter
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model.tp import TPShard, shard_adapter
from loraplex.engine.model_runner import ModelRunner, StepItem
from loraplex.engine.parallel.group import WorkerGroup

__all__ = ["ParallelRunner"]


class ParallelRunner(ModelRunner):
    """``ModelRunner`` of rank 0 with ``group``'s workers replaying its steps (module docstring).
    Built after every rank loaded its shard; the workers build their runners from the same
    arguments. CUDA graphs are off (the all-reduce is not captured yet)."""

    def __init__(self, group: WorkerGroup, model: CausalLM, **kw: Any) -> None:
        kw["use_cuda_graphs"] = False  # NOTE: decode graphs with NCCL inside: not built yet
        super().__init__(model, **kw)
        self.group = group
        self.tp_size = group.size
        group.send_all(("runner", kw))
        group.wait_all("ready")

    def execute(self, items: list[StepItem], feed: torch.Tensor | None = None) -> torch.Tensor:
        g = self.group
        g.check()
        n = -1 if feed is None else feed.numel()
        # NOTE: rows as plain tuples in StepItem's field order (40 % cheaper to pickle than
        # the dataclasses); one pickle for every worker
        rows = [
            (it.token_ids, it.start_pos, it.block_table, it.lora_slot, it.need_logits, it.feed_row)
            for it in items
        ]
        ranks = self.slot_ranks
        g.send_all(data=pickle.dumps(("step", rows, ranks.ranks, list(ranks.dora), n)))
        try:
            if feed is not None:
                dist.broadcast(feed.to(torch.int64).contiguous(), 0)
            return super().execute(items, feed)
        except Exception as e:
            raise g.failure(e) from e

    @torch.no_grad()
    def prepare_adapter(self, adapter: Any) -> tuple[PackedAdapter, ...]:
        """Every rank's packed shard of ``adapter``, kept on it as ``shard_images`` (blocking:
        the load's worker thread, once per load; they live as long as the adapter, i.e. while
        it is in the CPU tier)."""
        shards = getattr(adapter, "shard_images", None)
        if shards is None:
            g, r_max, dtype = self.group, self.model.max_lora_rank, self.model.dtype
            cuts = [shard_adapter(adapter, g.cfg, TPShard(rank, g.size)) for rank in range(g.size)]
            shards = tuple(pack_adapter(cut, r_max, dtype=dtype) for cut in cuts)
            adapter.shard_images = shards
        return shards

    @torch.no_grad()
    def write_slot(
        self, slot: int, adapter: Any, *, zero_rest: bool = True, had_dora: bool = True, **_: Any
    ) -> None:
        """Each worker its shard of ``adapter`` with the decisions (in order with the steps),
        then rank 0's (timing arguments of the side-stream writer do not apply here)."""
        g = self.group
        g.check()
        shards = self.prepare_adapter(adapter)  # (made at load time: an attribute read)
        decisions = {"zero_rest": zero_rest, "had_dora": had_dora}
        for rank in range(1, g.size):
            packed = shards[rank]
            raw = packed.buffer.view(torch.uint8).numpy()
            msg = ("write", slot, packed.entries, packed.max_rank, packed.dtype, decisions)
            g.send(rank, msg, raw)
        self.slot_buffers.write(slot, shards[0], **decisions)

    def close(self) -> None:
        self.group.close()
