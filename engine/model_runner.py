"""Model runner: turns scheduled sequence chunks into tensors, runs the model, returns logits.

It owns the model, the paged KV cache and the slot -> rank table that LoRA mappings need.
It knows nothing of requests or queues (that is the scheduler's job).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.lora.mapping import LoRAMapping
from loraplex.engine.model.attention import AttentionMetadata
from loraplex.engine.model.llama import LlamaForCausalLM

__all__ = ["StepItem", "ModelRunner"]


@dataclass
class StepItem:
    """One sequence's share of a step."""

    token_ids: list[int]  # tokens whose KV is computed this step
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]
    lora_slot: int = -1  # NOTE: -1 = base model
    need_logits: bool = True  # chunk ends at the sequence's last known token


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
    ) -> None:
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=self.device),
                torch.zeros(shape, dtype=model.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        max_loras = model.layers[0].qkv_proj.max_loras
        self.slot_ranks: list[int] = [0] * max_loras

    @staticmethod
    def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int) -> int:
        cfg = model.cfg
        elem = torch.empty((), dtype=model.dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _prepare(self, items: list[StepItem]) -> tuple[torch.Tensor, ...]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        last: list[int] = []
        for it in items:
            n = len(it.token_ids)
            ids += it.token_ids
            for p in range(it.start_pos, it.start_pos + n):
                pos.append(p)
                slots.append(it.block_table[p // bs] * bs + p % bs)
            token_slots += [it.lora_slot] * n
            qsl.append(qsl[-1] + n)
            ctx.append(it.start_pos + n)
            if it.need_logits:
                last.append(qsl[-1] - 1)
        width = max(len(it.block_table) for it in items)
        tables = [it.block_table + [0] * (width - len(it.block_table)) for it in items]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=torch.tensor(tables, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=qsl,
            context_lens=ctx,
            block_size=bs,
            is_decode=all(len(it.token_ids) == 1 for it in items),
        )
        mapping = (
            LoRAMapping.build(token_slots, self.slot_ranks, device=dev)
            if any(s >= 0 for s in token_slots)
            else None
        )
        return (
            torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True),
            meta,
            mapping,
            torch.tensor(last, dtype=torch.int64).to(dev, non_blocking=True),
        )

    @torch.inference_mode()
    def execute(self, items: list[StepItem]) -> torch.Tensor:
        """Run one step; returns float32 logits (one row per item with need_logits)."""
        ids, pos, meta, mapping, last = self._prepare(items)
        hidden = self.model(ids, pos, self.kv_caches, meta, mapping)
        return self.model.compute_logits(hidden.index_select(0, last))
