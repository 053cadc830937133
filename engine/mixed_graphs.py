"""CUDA graphs for steps that mix decode rows with short prefill chunks (``MixedGraphs``),
per (sequences, tokens) bucket, and for speculative verification steps (rows of 1 + K
tokens with logits at every position); they read every rank row of the LoRA slots (decode
graphs: cuda_graph.py)."""

from __future__ import annotations

from typing import Any

import torch

from loraplex.engine.cuda_graph import BUCKETS, _logits, capture_graph
from loraplex.engine.model.attention import AttentionMetadata
from loraplex.engine.model.fused import fused_forward
from loraplex.engine.model.gemm import tune
from loraplex.engine.model.paged_attention import paged_decode_attention, paged_prefill_attention
from loraplex.engine.model.protocol import CausalLM

__all__ = ["MixedGraphs", "MIXED_QMAX", "MIXED_EXTRAS"]

MIXED_QMAX = 64  # longest prefill chunk a mixed graph takes (its attention grid is fixed)
MIXED_EXTRAS = (16, 32, 64, 128, 256)  # prefill tokens on top of the decode rows, per bucket


class MixedGraphs:
    """CUDA graphs for steps that mix decode rows with short prefill chunks.

    A cold load ends with its requests' prefills: each one would otherwise turn the next step
    into an eager forward (~20 ms of Python launches for the 8B shape, against a 6 ms graph
    replay), and every running stream would feel it. A mixed step of S sequences
    and T tokens (every chunk <= ``MIXED_QMAX`` tokens) replays the graph of bucket
    (S_b, T_b): S_b a decode bucket >= S, T_b = S_b + the smallest extra in ``MIXED_EXTRAS``
    with T < T_b. The flat token rows are padded to T_b (no KV write, no adapter), the
    sequences to S_b (no rows, no context). Every per-step value is read from static device
    buffers, staged by one async copy from pinned memory.

    Attention is split so the decode rows cost what they cost in a decode graph: rows are laid
    out prefill chunks first, decode rows after (each part grouped by adapter slot). The
    prefill kernel (``max_query_len`` fixed at ``MIXED_QMAX``) sees only the prefill
    sequences; the decode kernel (split-K over long contexts) computes the last row of every
    sequence, which overwrites those rows (a prefill chunk's last row twice, the same value).

    Verification (``verify_k`` > 0: speculative decoding with K proposed tokens): a step with
    a row that wants logits at several positions (``num_logits`` > 1: 1 + its proposals) runs
    a *wide* bucket (S_b, T_b) whose graph computes the LM head over every token row and
    returns the rows asked for, each item's last ``num_logits`` in item order (the eager
    runner's layout). Its attention is the prefill launch alone, over every row (the decode
    rows as one-token rows): verify rows are short, so the launch splits their key ranges as
    decode does (``prefill_partitions``), and a second launch for the last rows would only
    repeat them. Wide buckets exist for S_b up to the bucket of ``verify_seqs`` rows and
    T_b up to the first that holds S_b x (K + 1) tokens: a verify step of up to
    ``speculative_max_running`` rows then replays a graph instead of ~20-30 ms of eager
    launches (8B shape).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_blocks_per_seq: int,
        seq_buckets: tuple[int, ...],
        max_tokens: int,
        pool: object = None,
        verify_k: int = 0,
        verify_seqs: int = 0,
        max_step_tokens: int = 1 << 30,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        buckets = []
        for s in seq_buckets:
            for e in MIXED_EXTRAS:
                buckets.append((s, s + e))
                if s + e >= max_tokens:
                    break
        self.buckets = tuple(buckets)
        self.wide_buckets = _wide_buckets(seq_buckets, verify_k, verify_seqs, max_step_tokens)
        every = buckets + list(self.wide_buckets)
        self.max_seqs = max(s for s, _ in every)
        self.max_t = max(t for _, t in every)
        dev = model.device
        i32, i64 = torch.int32, torch.int64
        n, m = self.max_t, self.max_seqs
        self.ids = torch.zeros(n, dtype=i64, device=dev)
        self.pos = torch.zeros(n, dtype=i64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=dev)
        self.token_slots = torch.full((n,), -1, dtype=i32, device=dev)
        self.qsl = torch.zeros(m + 1, dtype=i32, device=dev)  # prefill sequences only
        self.ctx = torch.zeros(m, dtype=i32, device=dev)
        self.last = torch.zeros(m, dtype=i64, device=dev)  # logits rows: need-logits items first
        self.wide_rows = torch.zeros(n, dtype=i64, device=dev)  # a wide bucket's logits rows
        # one logits buffer for every wide graph (consumed before the next replay, as the
        # decode graphs'); (a graph's own output: the few rows of a mixed bucket)
        wide_t = max((t for _, t in self.wide_buckets), default=0)
        vocab = model.lm_head.shape[0]
        self.wide_logits = (
            torch.empty(wide_t, vocab, dtype=torch.float32, device=dev) if wide_t else None
        )
        self.seq_last = torch.zeros(m, dtype=i64, device=dev)  # last row per sequence, layout order
        self.tables = torch.zeros(m, max_blocks_per_seq, dtype=i32, device=dev)
        # pipelined admission: token row i's input is feed[src[i]] where src[i] >= 0 (a decode
        # row of a running request, fed the token the step in flight samples)
        self.src = torch.full((n,), -1, dtype=i64, device=dev)
        self.feed = torch.zeros(max(n, BUCKETS[-1]), dtype=i64, device=dev)
        # (S_b, T_b, wide) -> the graph and its logits
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        size = 6 * n + 4 * m + 1 + m * max_blocks_per_seq
        self.hosts = [torch.zeros(size, dtype=i64).pin_memory() for _ in range(2)]
        self.staged = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.last_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def bucket(self, seqs: int, tokens: int, wide: bool = False) -> tuple[int, int] | None:
        # NOTE: t > tokens: row t - 1 is always padding, where padded sequences' attention goes
        for s, t in self.wide_buckets if wide else self.buckets:
            if s >= seqs and t > tokens:
                return s, t
        return None

    def fits(self, items: list, feed: torch.Tensor | None = None) -> bool:
        """A step these graphs can run: every chunk short, a bucket large enough, and some
        prefill or verification (decode-only steps have their own graphs); rows fed from the
        step in flight (``feed_row``) read ``feed`` on the device."""
        tokens, wide = 0, False
        for it in items:
            n = len(it.token_ids)
            if n > MIXED_QMAX or (it.feed_row >= 0 and feed is None) or it.num_logits > n:
                return False
            wide |= it.need_logits and it.num_logits > 1
            tokens += n
        if feed is not None and feed.shape[0] > self.feed.shape[0]:
            return False
        return tokens > len(items) and self.bucket(len(items), tokens, wide) is not None

    def _forward(self, sb: int, tb: int, wide: bool = False) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tb],
            block_tables=self.tables[:sb],
            query_start_loc=[0] * (sb + 1),  # NOTE: host lists unused by the kernels
            context_lens=[0] * sb,
            block_size=self.block_size,
            is_decode=False,
            query_start_loc_t=self.qsl[: sb + 1],
            context_lens_t=self.ctx[:sb],
            max_query_len=MIXED_QMAX,
        )
        seq_last = self.seq_last[:sb]

        def attention(q, k_cache, v_cache, meta, scale, window):  # noqa: ANN001
            out = paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc_t,
                meta.context_lens_t, MIXED_QMAX, scale, window,
            )  # fmt: skip
            if wide:  # one launch: its rows include the decode rows (``_layout``)
                return out
            last = paged_decode_attention(
                q.index_select(0, seq_last), k_cache, v_cache, meta.block_tables,
                meta.context_lens_t, scale, window,
            )  # fmt: skip
            return out.index_copy_(0, seq_last, last)

        src = self.src[:tb]
        ids = torch.where(src >= 0, self.feed[src.clamp(min=0)], self.ids[:tb])
        hidden = fused_forward(
            self.model, ids, self.pos[:tb], self.kv_caches, meta, self.token_slots[:tb], attention,
            dora=True,
        )  # fmt: skip
        last = self.wide_rows[:tb] if wide else self.last[:sb]
        rows = self.token_slots[:tb].index_select(0, last)
        out = self.wide_logits if wide else None
        return _logits(self.model, hidden.index_select(0, last), rows, out)

    def capture_all(self) -> None:
        for key in [(*b, False) for b in self.buckets] + [(*b, True) for b in self.wide_buckets]:
            if key not in self.graphs:
                self.capture(*key)

    def capture(self, sb: int, tb: int, wide: bool = False) -> None:
        layer = self.model.layers[0]
        mods = tuple(dict.fromkeys(layer.lora_linears().values()))  # qkv, o, (gate_up, down)
        tune([m.weight_aug for m in mods if m.float_base], tb)  # fp8 bases: CONFIGS
        tune([self.model.lm_head], tb if wide else sb)
        graph, logits = capture_graph(
            lambda: self._forward(sb, tb, wide), self.model.device, self.pool
        )
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(sb, tb, wide)] = (graph, logits)

    def run(self, items: list, feed: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the bucket's graph for ``items`` (``fits`` must hold); returns the logits of
        the items with ``need_logits``, in item order, ``num_logits`` rows each (a view:
        consume it before the next replay). Rows are laid out grouped by adapter slot (the
        epilogues' B tiles). An item with ``feed_row >= 0`` reads its one input token from
        ``feed[feed_row]`` (device)."""
        seqs, tokens = len(items), sum(len(it.token_ids) for it in items)
        wide = any(it.need_logits and it.num_logits > 1 for it in items)
        key = self.bucket(seqs, tokens, wide)
        assert key is not None
        sb, tb = key
        width = self.tables.shape[1]
        self.turn ^= 1
        self.staged[self.turn].synchronize()  # this buffer's previous copy has left it
        n = 6 * tb + 4 * sb + 1 + sb * width
        host_t = self.hosts[self.turn][:n]
        out = _layout(items, host_t.numpy(), sb, tb, width, self.block_size, wide)
        dev = host_t.to(self.model.device, non_blocking=True)
        self.staged[self.turn].record()
        dtok = dev[: 6 * tb].view(6, tb)
        self.ids[:tb].copy_(dtok[0])
        self.pos[:tb].copy_(dtok[1])
        self.slot_mapping[:tb].copy_(dtok[2])
        self.token_slots[:tb].copy_(dtok[3])
        self.src[:tb].copy_(dtok[4])
        if wide:
            self.wide_rows[:tb].copy_(dtok[5])
        if feed is not None:
            self.feed[: feed.shape[0]].copy_(feed)
        dseq = dev[6 * tb : 6 * tb + 4 * sb + 1]
        self.qsl[: sb + 1].copy_(dseq[: sb + 1])
        self.ctx[:sb].copy_(dseq[sb + 1 : 2 * sb + 1])
        self.last[:sb].copy_(dseq[2 * sb + 1 : 3 * sb + 1])
        self.seq_last[:sb].copy_(dseq[3 * sb + 1 :])
        self.tables[:sb].copy_(dev[6 * tb + 4 * sb + 1 :].view(sb, width))
        if (*key, wide) not in self.graphs:
            self.capture(*key, wide)
        graph, logits = self.graphs[(*key, wide)]
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        graph.replay()
        events[1].record()
        self.last_events = events
        return logits[:out]


def _layout(items: list, host: Any, sb: int, tb: int, width: int, bs: int, wide: bool) -> int:
    """Fill ``host`` (numpy int64, ``6 * tb + 4 * sb + 1 + sb * width``) with a step's
    per-row and per-sequence values in ``MixedGraphs``' order (``run`` copies it to the static
    buffers); returns how many logits rows the step asks for."""
    seqs = len(items)
    host[:] = 0
    # ids, pos, slot_mapping, token_slots, src, wide_rows
    tok = host[: 6 * tb].reshape(6, tb)
    seq = host[6 * tb : 6 * tb + 4 * sb + 1]
    qsl, ctx = seq[: sb + 1], seq[sb + 1 : 2 * sb + 1]
    last, seq_last = seq[2 * sb + 1 : 3 * sb + 1], seq[3 * sb + 1 :]
    rows = host[6 * tb + 4 * sb + 1 :].reshape(sb, width)
    tok[2, :] = tok[3, :] = tok[4, :] = -1
    tok[5, :] = tb - 1  # (a padding row)
    # prefill chunks first, then decode rows; each part grouped by adapter slot
    order = sorted(range(seqs), key=lambda i: (len(items[i].token_ids) == 1, items[i].lora_slot))
    end = [0] * seqs
    row = prefills = 0
    for k, i in enumerate(order):
        it = items[i]
        m, p0, table = len(it.token_ids), it.start_pos, it.block_table
        tok[0, row : row + m] = it.token_ids
        tok[1, row : row + m] = range(p0, p0 + m)
        tok[2, row : row + m] = [table[p // bs] * bs + p % bs for p in range(p0, p0 + m)]
        tok[3, row : row + m] = it.lora_slot
        if it.feed_row >= 0:
            tok[4, row] = it.feed_row
        if m > 1 or wide:
            qsl[k] = row
            prefills = k + 1
        ctx[k] = p0 + m
        rows[k, : len(table)] = table
        row += m
        end[i] = seq_last[k] = row - 1
    qsl[prefills:] = qsl[prefills - 1] + len(items[order[prefills - 1]].token_ids)
    seq_last[seqs:] = tb - 1  # a padding row (see bucket)
    need = [i for i in range(seqs) if items[i].need_logits]
    rest = [i for i in range(seqs) if not items[i].need_logits]
    last[:seqs] = [end[i] for i in need + rest]
    out = len(need)
    if wide:  # each item's last num_logits rows, in item order
        picked = [r for i in need for r in range(end[i] + 1 - items[i].num_logits, end[i] + 1)]
        tok[5, : len(picked)] = picked
        out = len(picked)
    return out


def _wide_buckets(
    seq_buckets: tuple[int, ...], k: int, max_seqs: int, max_tokens: int = 1 << 30
) -> tuple[tuple[int, int], ...]:
    """Verification buckets (S_b, T_b): S_b a decode bucket up to the first that holds
    ``max_seqs`` rows, T_b = S_b + an extra of ``MIXED_EXTRAS`` up to the first that holds
    S_b rows of 1 + ``k`` tokens (or ``max_tokens``, a step's token budget), then one of
    exactly that size if the extras end before it (none when ``k`` is 0)."""
    out: list[tuple[int, int]] = []
    if k <= 0 or max_seqs <= 0:
        return ()
    for s in seq_buckets:
        need = min(s * (k + 1), max_tokens)  # tokens the bucket must hold (< T_b)
        for e in MIXED_EXTRAS:
            out.append((s, s + e))
            if s + e > need:
                break
        else:
            out.append((s, need + 1))
        if s >= max_seqs:
            break
    return tuple(out)
