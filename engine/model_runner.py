"""Model runner: turns scheduled sequence chunks into tensors, runs the model, returns logits.

It owns the model, the paged KV cache, the slot -> rank table that LoRA mappings need
(``slot_ranks``, set by the adapters' slot store) and the device half of slot writes
(``slot_buffers``).
It knows nothing of requests or queues (that is the scheduler's job). Its kernel backend
(``model/backend.py``) is fixed at construction: the fused GPU forward or the reference one,
LoRA kernels in Triton or as torch twins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loraplex.engine.cuda_graph import DecodeGraphs
from loraplex.engine.model.attention import AttentionMetadata
from loraplex.engine.model.backend import KernelBackend, resolve_kernel_backend
from loraplex.engine.model.fused import fused_forward
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.lora.ranks import SlotRanks, step_rank
from loraplex.engine.model.lora.slot_buffers import SlotBuffers
from loraplex.engine.model.protocol import CausalLM

__all__ = ["StepItem", "ModelRunner"]


@dataclass
class StepItem:
    """One sequence's share of a step."""

    token_ids: list[int]  # tokens whose KV is computed this step
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]
    lora_slot: int = -1  # NOTE: -1 = base model
    need_logits: bool = True  # chunk ends at the sequence's last known token
    # >= 0: the (single) input token is row ``feed_row`` of the previous step's sampled ids,
    # still on the device (pipelined decode); ``token_ids`` then holds a placeholder
    feed_row: int = -1
    # logits rows of this item when ``need_logits``: its last ``num_logits`` positions
    # (speculative verification: 1 + the proposed tokens; eager steps only)
    num_logits: int = 1


class ModelRunner:
    tp_size = 1  # ranks of tensor parallelism (parallel/runner.py: rank 0's runner of N)

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int | None = None,
        use_cuda_graphs: bool = True,
        max_graph_batch: int = 256,
        kernel_backend: str | KernelBackend = "auto",
        graph_sizes: tuple[int, ...] | None = None,
    ) -> None:
        max_model_len = max_model_len or model.cfg.max_position_embeddings
        cfg = model.cfg
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # auto: augmented GEMMs + fused kernels (model/fused.py) on GPU, the reference path on CPU
        self.backend = resolve_kernel_backend(kernel_backend, self.device)
        self.fused = self.backend.fused
        model.set_base_layout(transposed=not self.fused)  # see CausalLM.set_base_layout
        # NOTE: the reference path keeps one spare block past num_blocks that no table names
        # and nothing writes: its zeros stand in for key slots past a sequence's length
        spare = 0 if self.fused else 1
        shape = (num_blocks + spare, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.zero_slot = None if self.fused else num_blocks * block_size
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=self.device),
                torch.zeros(shape, dtype=model.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.slot_ranks = SlotRanks(model.max_loras)  # (DoRA slots: model/lora/dora.py)
        self.slot_buffers = SlotBuffers(model)
        self.graphs: DecodeGraphs | None = None
        self.last_was_graph = False
        self.last_events: tuple | None = None  # CUDA events around the last graph replay
        # NOTE: the graphs run the Triton epilogues (cuda_graph.py); a twins backend stays eager
        if self.fused and self.backend.triton and self.device.type == "cuda" and use_cuda_graphs:
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size=block_size,
                max_blocks_per_seq=-(-max_model_len // block_size),
                max_batch=max_graph_batch,
                sizes=graph_sizes,
            )

    def write_slot(self, slot: int, adapter: Any, **decisions: Any) -> None:
        """Write ``adapter`` into ``slot`` now, on the current stream: the target of the
        adapters' slot writer (``decisions``: ``SlotBuffers.write``'s ``zero_rest``,
        ``had_dora``, ``h2d_done``, ``chunk_bytes``, ``pace``)."""
        self.slot_buffers.write(slot, adapter, **decisions)

    def close(self) -> None:
        """Release what the runner started (nothing here; worker processes under TP)."""

    @staticmethod
    def kv_bytes_per_block(model: CausalLM, block_size: int) -> int:
        cfg = model.cfg
        elem = torch.empty((), dtype=model.dtype).element_size()
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _prepare(self, items: list[StepItem]) -> tuple[torch.Tensor, ...]:
        bs = self.block_size
        ids: list[int] = []
        src: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        token_slots: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        last: list[int] = []
        for it in items:
            n = len(it.token_ids)
            ids += it.token_ids
            src += [it.feed_row] if n == 1 else [-1] * n
            for p in range(it.start_pos, it.start_pos + n):
                pos.append(p)
                slots.append(it.block_table[p // bs] * bs + p % bs)
            token_slots += [it.lora_slot] * n
            qsl.append(qsl[-1] + n)
            ctx.append(it.start_pos + n)
            if it.need_logits:
                last += range(qsl[-1] - it.num_logits, qsl[-1])
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
            zero_slot=self.zero_slot,
        )
        mapping = (  # NOTE: the fused path reads token slots directly, no segments
            LoRAMapping.build(
                token_slots,
                self.slot_ranks.ranks,
                dev,
                triton=self.backend.triton,
                dora_slots=self.slot_ranks.dora,
            )  # fmt: skip
            if not self.fused and any(s >= 0 for s in token_slots)
            else None
        )
        return (
            torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True),
            torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True),
            meta,
            mapping,
            torch.tensor(last, dtype=torch.int64).to(dev, non_blocking=True),
        )

    @torch.inference_mode()
    def execute(self, items: list[StepItem], feed: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns logits (one row per item with need_logits, in item order).

        ``feed``: the previous step's sampled token ids on the device, read by items with a
        ``feed_row`` (no host round trip between the two steps).

        Rows are grouped by adapter slot first. Fused path: the LoRA epilogues handle a block
        of rows per program and load one B tile per distinct slot in it. Reference (CPU) path:
        each slot's rows are then one run of rows (``LoRAMapping.runs``), sliced, not gathered.
        """
        if any(it.feed_row >= 0 for it in items) and feed is None:
            raise ValueError("items read the previous step's tokens but no feed was given")
        if not self.fused and all(it.lora_slot < 0 for it in items):
            return self._execute(items, feed)
        order = sorted(range(len(items)), key=lambda i: items[i].lora_slot)
        if order == list(range(len(items))):
            return self._execute(items, feed)
        logits = self._execute([items[i] for i in order], feed)
        # each item's logits rows: where they are in item order, and in the sorted step
        start, at = {}, 0
        for i, it in enumerate(items):
            if it.need_logits:
                start[i], at = at, at + it.num_logits
        inv = [0] * at
        k = 0
        for i in order:
            if items[i].need_logits:
                for j in range(items[i].num_logits):
                    inv[start[i] + j] = k
                    k += 1
        index = torch.tensor(inv)
        if logits.device.type == "cuda":
            index = index.pin_memory()  # NOTE: async copy; a pageable one would sync the step
        return logits.index_select(0, index.to(logits.device, non_blocking=True))

    def _execute(self, items: list[StepItem], feed: torch.Tensor | None) -> torch.Tensor:
        self.last_was_graph = self.graphs is not None and self._graphable(items)
        if self.last_was_graph:
            return self._execute_graph(items, feed)
        self.last_events = None
        ids, src, pos, meta, mapping, last = self._prepare(items)
        if feed is not None:
            ids = torch.where(src >= 0, feed[src.clamp(min=0)], ids)
        if self.fused:
            dev = self.device
            slots = [it.lora_slot for it in items for _ in it.token_ids]
            token_slots = torch.tensor(slots, dtype=torch.int32).to(dev, non_blocking=True)
            meta.query_start_loc_t = torch.tensor(meta.query_start_loc, dtype=torch.int32).to(
                dev, non_blocking=True
            )
            meta.context_lens_t = torch.tensor(meta.context_lens, dtype=torch.int32).to(
                dev, non_blocking=True
            )
            meta.max_query_len = max(len(it.token_ids) for it in items)
            hidden = fused_forward(
                self.model, ids, pos, self.kv_caches, meta, token_slots,
                triton=self.backend.triton, dora=self.has_dora(items),
            )  # fmt: skip
            rows = LoRAMapping(token_slots.index_select(0, last), triton=self.backend.triton)
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta, mapping)
            rows = None
            if mapping is not None:  # the logits rows' slots: their LM head LoRA deltas
                rows = LoRAMapping(mapping.token_slots.index_select(0, last), triton=mapping.triton)
        return self.model.compute_logits(hidden.index_select(0, last), rows)

    def has_dora(self, items: list[StepItem]) -> bool:
        """Some row's slot holds a DoRA adapter: an eager step applies the row scales (the
        graphs always do; no cost while none is resident)."""
        dora = self.slot_ranks.dora
        return bool(dora) and any(it.lora_slot in dora for it in items)

    def _graphable(self, items: list[StepItem]) -> bool:
        assert self.graphs is not None
        # NOTE: the graphs apply DoRA row scales in their epilogues (fused_forward's ``dora``)
        return (
            all(len(it.token_ids) == 1 and it.need_logits and it.num_logits == 1 for it in items)
            and len(items) <= self.graphs.max_batch
        )

    def _execute_graph(self, items: list[StepItem], feed: torch.Tensor | None) -> torch.Tensor:
        assert self.graphs is not None
        bs = self.block_size
        slots = [it.block_table[it.start_pos // bs] * bs + it.start_pos % bs for it in items]
        logits = self.graphs.run(
            ids=[it.token_ids[0] for it in items],
            pos=[it.start_pos for it in items],
            slots=slots,
            tables=[it.block_table for it in items],
            ctx=[it.start_pos + 1 for it in items],
            token_slots=[it.lora_slot for it in items],
            src=[it.feed_row for it in items],
            feed=feed,
            rank=step_rank((it.lora_slot for it in items), self.slot_ranks.ranks),  # rank bucket
        )
        self.last_events = self.graphs.last_events
        return logits
