"""Rank 0's model runner of a tensor-parallel engine: each step and slot write sent once to the
workers, which replay it on their shards (worker.py).

The executor drives it as any ``ModelRunner``: ``execute(items, feed)`` sends the step's items
(token ids, positions and block tables; slot of each row) with the slot -> rank table, then
runs rank 0's own shard; the collectives inside the forward keep the ranks in step. A
pipelined step's feed (the previous step's sampled ids, on rank 0 only) goes to the workers by
one broadcast. Sampling needs nothing from the workers: the vocab-parallel LM head gathers the
logits on every rank.

Slot writes: the adapter arrives as the loader staged it, whole (full-model layout). Each
rank's shard (``tp.shard_adapter``) is packed and written into that rank's slot: rank 0's
here, the others' sent as one raw buffer each, in order with the steps. Writes are synchronous
on the compute stream (no side stream under TP yet).

Any exception in a step fails the group (``WorkerGroup.failure``): after a collective broke
the ranks cannot be brought back in step, so every later step raises the same typed error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from loraplex.engine.lora.slots import write_slot
from loraplex.engine.lora.staging import pack_adapter
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
        g.send_all(("step", items, self.slot_ranks, sorted(self.dora_slots), n))
        try:
            if feed is not None:
                dist.broadcast(feed.to(torch.int64).contiguous(), 0)
            return super().execute(items, feed)
        except Exception as e:
            raise g.failure(e) from e

    @torch.no_grad()
    def write_slot(self, slot: int, adapter: Any) -> None:
        g = self.group
        g.check()
        r_max, dtype = self.model.max_lora_rank, self.model.dtype
        for rank in (*range(1, g.size), 0):
            shard = shard_adapter(adapter, g.cfg, TPShard(rank, g.size))
            packed = pack_adapter(shard, r_max, dtype=dtype)
            if rank == 0:
                write_slot(self.model, slot, packed)
                continue
            raw = packed.buffer.view(torch.uint8).numpy()
            g.send(rank, ("write", slot, packed.entries, r_max, dtype), raw)

    def close(self) -> None:
        self.group.close()
