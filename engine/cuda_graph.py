"""CUDA graphs for decode steps, one per (batch-size bucket, rank bucket).

A decode step (one new token per sequence) is replayed from a graph captured on static
buffers; the batch is padded up to the bucket with rows that write no KV (slot -1), read no
context (length 0) and use no adapter (slot -1). Everything a kernel needs at replay time is
read from these device buffers, never from host values, so the captured launches stay valid.

Rank buckets (model/lora/ranks.py): a decode graph of rank bucket r_b reads only the A rows of
ranks < r_b of every slot and loops over r_b rank columns, so a step whose adapters all have
rank <= r_b costs what it costs in an engine of ``max_lora_rank`` r_b. The step's bucket is
the smallest one >= the largest rank among its rows' slots (``run(rank=...)``). Buckets above
``max_lora_rank`` are never captured; all graphs of a bucket set share one logits buffer.
Mixed-step graphs (mixed_graphs.py) read every rank row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraplex.engine.model.attention import AttentionMetadata
from loraplex.engine.model.fused import fused_forward
from loraplex.engine.model.gemm import linear, tune
from loraplex.engine.model.lora.ranks import rank_bucket, rank_buckets
from loraplex.engine.model.protocol import CausalLM

__all__ = ["DecodeGraphs", "BUCKETS", "capture_graph"]

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


def capture_graph(
    forward: Callable[[], torch.Tensor], device: torch.device, pool: object
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One warm-up call of ``forward`` on a side stream (compiles kernels, sizes cuBLAS
    workspaces), then its capture into a graph sharing memory ``pool``."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: loader / slot-writer threads may copy while we capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()
    return graph, out


def _logits(
    model: CausalLM,
    hidden: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, V) float32 logits of ``hidden`` rows, each with its slot's LM head LoRA delta (and
    a full-table slot's own head: ``model.full_modules``, present only when configured).
    ``out``: (>= N, V) float32 buffer the logits are cast into (the same one launch as
    ``.float()``), shared by graphs that never run at once."""
    logits = linear(hidden, model.lm_head)
    if out is not None and logits.dtype != torch.float32:
        logits = out[: hidden.shape[0]].copy_(logits)
    else:
        logits = logits.float()
    full = getattr(model, "full_modules", None)  # modules_to_save tables (model/lora/full.py)
    if full is not None and full.extra:  # V + E wide: LoRA deltas on the base's, then widened
        head = model.lora_vocab().get("lm_head")
        if head is not None:
            head.add(logits, hidden, token_slots, triton=True)
        return full.widen_logits(logits, hidden, token_slots, triton=True)
    if full is not None:
        full.head_logits(logits, hidden, token_slots, triton=True)
    head = model.lora_vocab().get("lm_head")
    if head is not None and getattr(model, "tp", None) is None:
        head.add(logits, hidden, token_slots, triton=True)
    return logits


class DecodeGraphs:
    NVEC = 6  # per-row vectors staged each step: ids, pos, slots, ctx, token_slots, src

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_blocks_per_seq: int,
        max_batch: int = 256,
        sizes: tuple[int, ...] | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        # the batch buckets: ``sizes`` (EngineConfig.cuda_graph_sizes) or BUCKETS up to max_batch
        self.buckets = (
            tuple(sorted(sizes)) if sizes else tuple(b for b in BUCKETS if b <= max_batch)
        )
        self.max_batch = self.buckets[-1]
        dev = model.device
        n = self.max_batch
        i32, i64 = torch.int32, torch.int64
        self.ids = torch.zeros(n, dtype=i64, device=dev)
        self.pos = torch.zeros(n, dtype=i64, device=dev)
        self.slots = torch.full((n,), -1, dtype=i64, device=dev)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=i32, device=dev)
        self.ctx = torch.zeros(n, dtype=i32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=i32, device=dev)
        self.token_slots = torch.full((n,), -1, dtype=i32, device=dev)
        # pipelined decode: row i's input token is feed[src[i]] where src[i] >= 0
        self.src = torch.full((n,), -1, dtype=i64, device=dev)
        self.feed = torch.zeros(n, dtype=i64, device=dev)
        # rank buckets of the graphs; (None,): a model without slots (every rank row, none)
        max_rank = model.max_lora_rank if model.max_loras > 0 else 0
        self.rank_buckets: tuple[int | None, ...] = rank_buckets(max_rank) if max_rank else (None,)
        # one logits buffer for every decode graph (a graph's logits are consumed before the
        # next replay: sampling is queued behind it on the same stream)
        vocab = model.lm_head.shape[0]
        self.logits = torch.empty(n, vocab, dtype=torch.float32, device=dev)
        self.graphs: dict[tuple[int, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        # two persistent pinned staging buffers, used in turn: one async H2D copy per step, no
        # allocation, and the next step's inputs are written while this step's copy is queued
        size = self.NVEC * n + n * max_blocks_per_seq
        self.hosts = [torch.zeros(size, dtype=i64).pin_memory() for _ in range(2)]
        self.staged = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.last_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def bucket(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def rank_bucket(self, rank: int) -> int | None:
        """The rank bucket of a step whose rows' adapters have rank <= ``rank``."""
        if self.rank_buckets[0] is None:
            return None
        return rank_bucket(rank, self.rank_buckets)  # type: ignore[arg-type]

    def _forward(self, bs: int, rb: int | None) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bs],
            block_tables=self.tables[:bs],
            query_start_loc=list(range(bs + 1)),
            context_lens=[0] * bs,  # NOTE: host list unused by the kernels
            block_size=self.block_size,
            is_decode=True,
            query_start_loc_t=self.qsl[: bs + 1],
            context_lens_t=self.ctx[:bs],
            max_query_len=1,
        )
        src = self.src[:bs]
        ids = torch.where(src >= 0, self.feed[src.clamp(min=0)], self.ids[:bs])
        hidden = fused_forward(
            self.model, ids, self.pos[:bs], self.kv_caches, meta, self.token_slots[:bs],
            rank_bound=rb, dora=True,
        )  # fmt: skip
        # = model.compute_logits
        return _logits(self.model, hidden, self.token_slots[:bs], self.logits)

    def gemm_weights(self, rb: int | None = None) -> list[torch.Tensor]:
        """The weights of the GEMMs a graph of rank bucket ``rb`` runs (their prefixes)."""
        layer = self.model.layers[0]
        mods = tuple(dict.fromkeys(layer.lora_linears().values()))  # qkv, o, (gate_up, down)
        return [m.aug_rows(rb)[0] for m in mods if m.float_base] + [self.model.lm_head]

    @property
    def keys(self) -> list[tuple[int, int | None]]:
        """(batch bucket, rank bucket) of every graph."""
        return [(bs, rb) for rb in self.rank_buckets for bs in self.buckets]

    def capture_all(self) -> None:
        """Capture every bucket now (startup), not on a bucket's first use mid-serving."""
        for bs, rb in self.keys:
            if (bs, rb) not in self.graphs:
                self.capture(bs, rb)

    def capture(self, bs: int, rb: int | None = None) -> None:
        tune(self.gemm_weights(rb), bs)  # BLAS backend per GEMM shape, recorded by the capture
        graph, logits = capture_graph(lambda: self._forward(bs, rb), self.model.device, self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bs, rb)] = (graph, logits)

    def run(
        self,
        ids: list[int],
        pos: list[int],
        slots: list[int],
        tables: list[list[int]],
        ctx: list[int],
        token_slots: list[int],
        src: list[int] | None = None,
        feed: torch.Tensor | None = None,
        rank: int | None = None,
    ) -> torch.Tensor:
        """Replay the bucket's graph for this batch; returns logits (B, V) (a view: consume it
        before the next replay). Row i with ``src[i] >= 0`` reads its input token from
        ``feed[src[i]]`` (device) instead of ``ids[i]``. ``rank``: the largest rank among the
        rows' slots (None: every rank row). ``last_events`` then holds CUDA events around this
        replay."""
        b = len(ids)
        bs = self.bucket(b)
        assert bs is not None
        rb = self.rank_buckets[-1] if rank is None else self.rank_bucket(rank)
        width = self.tables.shape[1]
        nv = self.NVEC
        # pinned host buffer, one async copy: no host sync inside the step
        self.turn ^= 1
        self.staged[self.turn].synchronize()  # this buffer's previous copy has left it
        n = nv * bs + bs * width
        host_t = self.hosts[self.turn][:n]
        host = host_t.numpy()
        host[:] = 0
        vec = host[: nv * bs].reshape(nv, bs)
        vec[0, :b], vec[1, :b], vec[2, :b], vec[3, :b], vec[4, :b] = (
            ids,
            pos,
            slots,
            ctx,
            token_slots,
        )
        vec[5, :b] = src if src is not None else -1
        vec[2, b:] = vec[4, b:] = vec[5, b:] = -1
        rows = host[nv * bs :].reshape(bs, width)
        for i, t in enumerate(tables):
            rows[i, : len(t)] = t
        dev = host_t.to(self.model.device, non_blocking=True)
        self.staged[self.turn].record()
        dvec = dev[: nv * bs].view(nv, bs)
        self.ids[:bs].copy_(dvec[0])
        self.pos[:bs].copy_(dvec[1])
        self.slots[:bs].copy_(dvec[2])
        self.ctx[:bs].copy_(dvec[3])
        self.token_slots[:bs].copy_(dvec[4])
        self.src[:bs].copy_(dvec[5])
        self.tables[:bs].copy_(dev[nv * bs :].view(bs, width))
        if feed is not None:
            self.feed[: feed.shape[0]].copy_(feed)
        if (bs, rb) not in self.graphs:
            self.capture(bs, rb)
        graph, logits = self.graphs[(bs, rb)]
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        graph.replay()
        events[1].record()
        self.last_events = events
        return logits[:b]
