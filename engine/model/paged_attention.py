"""Triton attention over the paged KV cache: decode (split-K) and prefill kernels + a dispatcher.

Semantics are those of ``attention.paged_attention_reference``: for sequence ``i`` with
``n_i`` query rows and ``ctx_i`` cached tokens, query ``j`` sits at ``p = ctx_i - n_i + j`` and::

    for h in range(Hq):
        keys = [k for k in range(ctx_i) if k <= p and (window is None or k > p - window)]
        out[row, h] = softmax(q[row, h] · K[keys, h // G] * scale) @ V[keys, h // G]

A row without keys (a padded decode row, ``ctx_i == 0``) gets zeros.

One program owns ``BLOCK_M`` rows = ``BLOCK_M // G_PAD`` queries x the ``G`` query heads of one
KV head, so every K/V tile is loaded once per group. It walks key tiles of ``BLOCK_N`` tokens,
gathering each token through ``block_tables`` (so tiles need not align with cache blocks), with
an fp32 online softmax in the log2 domain. Decode may split the key range of every (sequence,
KV head) into ``NUM_PARTS`` partitions (flash-decoding) whose partial results a second, tiny
kernel merges: at most two launches, and the grid depends only on ``B``, the heads and the
block-table width, so the call can be captured in a CUDA graph.

No Triton library ``@jit`` helpers (``tl.max``, ``tl.sum``, ``tl.zeros``): decorated at Triton's
import, they refuse to run under a later ``TRITON_INTERPRET=1``. ``tl.reduce`` with Triton's own
combine functions is what ``tl.max``/``tl.sum`` compile to, and the interpreter knows them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from loraplex.engine.model.attention import AttentionMetadata, paged_attention_reference
from loraplex.engine.model.backend import triton_reaches
from loraplex.engine.model.kernels.launch_table import GENERIC, LaunchTable, Rule, device_sms

__all__ = [
    "DECODE_TILES", "PREFILL_TILES", "PagedInputs", "Tiles", "decode_partitions", "decode_tiles",
    "device_sms", "device_tensors", "paged_attention", "paged_decode_attention",
    "paged_prefill_attention", "prefill_partitions",
]  # fmt: skip

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, ml_ptr, bt_ptr, qsl_ptr, ctx_ptr,
    qk_scale, window, num_heads,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUPS: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_PARTS: tl.constexpr, IS_DECODE: tl.constexpr, USE_WINDOW: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_PARTS
    part = tl.program_id(2) % NUM_PARTS
    if IS_DECODE:
        start = seq
        n = 1
    else:
        start = tl.load(qsl_ptr + seq)
        n = tl.load(qsl_ptr + seq + 1) - start
    q0 = pid_m * BLOCK_Q
    if q0 >= n:
        return
    ctx = tl.load(ctx_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // G_PAD
    head = kvh * GROUPS + rows % G_PAD
    row_ok = (qi < n) & (rows % G_PAD < GROUPS)
    qpos = ctx - n + qi
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok = (start + qi).to(tl.int64)

    # Key tiles [t_lo, t_hi) cover [lo, hi): hi = last query of the tile + 1, lo = window start
    # of the first one; every such tile holds at least one allowed key of the tile's queries.
    hi = ctx - n + tl.minimum(q0 + BLOCK_Q, n)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - n + q0 - window + 1, 0)
    t_lo = lo // BLOCK_N
    t_hi = (hi + BLOCK_N - 1) // BLOCK_N
    if NUM_PARTS > 1:
        per = (t_hi - t_lo + NUM_PARTS - 1) // NUM_PARTS
        t_lo = t_lo + part * per
        t_hi = tl.minimum(t_hi, t_lo + per)

    q_ptrs = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t_lo, t_hi):
        kpos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = kpos % BLOCK_SIZE
        k_ptrs = k_ptr + blk[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None]
        kt = tl.load(k_ptrs + kvh * stride_kh, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=FP32_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if IS_DECODE:
            allowed = k_ok[None, :] & row_ok[:, None]
        else:
            allowed = (kpos[None, :] <= qpos[:, None]) & row_ok[:, None]
        if USE_WINDOW:
            allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v_ptrs = v_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :]
        v = tl.load(v_ptrs + kvh * stride_vh, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=FP32_PRECISION)
        m_i = m_new

    if NUM_PARTS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials (T, Hq, NUM_PARTS, BLOCK_D) and (T, Hq, NUM_PARTS, 2), unnormalised
        idx = (tok * num_heads + head) * NUM_PARTS + part
        tl.store(part_ptr + idx[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + idx * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + idx * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(
    out_ptr, part_ptr, ml_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PARTS: tl.constexpr, P_PAD: tl.constexpr,
):  # fmt: skip
    """out[t, h] = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p  (0 when no partition saw keys)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, P_PAD)
    p_ok = parts < NUM_PARTS
    idx = (tok * num_heads + head) * NUM_PARTS + parts
    m = tl.load(ml_ptr + idx * 2, mask=p_ok, other=float("-inf"))
    lsum = tl.load(ml_ptr + idx * 2 + 1, mask=p_ok, other=0.0)
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty partitions: 0
    denom = tl.reduce(w * lsum, 0, tl.standard._sum_combine)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(
        part_ptr + idx[:, None] * BLOCK_D + offs_d[None, :], mask=p_ok[:, None], other=0.0
    )
    o = tl.reduce(acc * w[:, None], 0, tl.standard._sum_combine)
    o = o / tl.where(denom == 0.0, 1.0, denom)
    o_ptrs = out_ptr + tok * stride_ot + head * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


class Tiles(NamedTuple):
    """Default tiles of a launch: ``block_n`` keys a step; decode: ``parts`` partitions (None:
    ``decode_partitions``); prefill: ``block_m`` rows (queries x padded heads) at most."""

    block_n: int
    parts: int | None = None
    block_m: int = 0


# sm_90 register budgets without spills: bf16 D <= 128 decode 16 x 64 ~116 registers, prefill
# 128 x 64 at 8 warps ~200; D = 256 takes half the keys; fp32 (FMA dots, the tests) smaller
# tiles still. A decode grid that already holds about two programs per SM at one partition
# (``half_waves`` = 2 x programs // SMs in 3..5, i.e. 1.5-3 programs per SM: 25-49 sequences of
# 8 KV heads on 132 SMs) reads the context in 128-key tiles, unsplit: at 32 sequences on 132
# SMs the fastest form at every context timed (ctx 512 / 2048 / 4000: 22.2 / 68.2 / 128.0 µs
# against 25.0 / 72.2 / 132.8 for two partitions of 64-key tiles; the 128-key tile split in two
# is the slowest; ``benchmarks/base_configs.py --only attention``).
_DECODE_SM90: tuple[Rule[Tiles], ...] = (
    Rule(Tiles(128, 1), fp32=0, head_dim=(None, 128), half_waves=(3, 5)),
    Rule(Tiles(64), fp32=0, head_dim=(None, 128)),
    Rule(Tiles(32), fp32=0),
    Rule(Tiles(16)),
)
_PREFILL_SM90: tuple[Rule[Tiles], ...] = (
    Rule(Tiles(32, block_m=32), fp32=1),
    Rule(Tiles(32, block_m=64), head_dim=(129, None)),
    Rule(Tiles(64, block_m=128)),
)
# Generic: the sm_90 rows. They take at most 74 KB of shared memory a block on sm_80 / sm_86 /
# sm_89 (the 128-key decode tile at D = 128; prefill 128 x 64: 66 KB), so they run on any GPU;
# other GPUs' fastest tiles were not measured.
DECODE_TILES = LaunchTable("attention_decode", {"sm90": _DECODE_SM90, GENERIC: _DECODE_SM90})
PREFILL_TILES = LaunchTable("attention_prefill", {"sm90": _PREFILL_SM90, GENERIC: _PREFILL_SM90})


def decode_partitions(batch: int, num_kv_heads: int, max_ctx: int, block_n: int, sms: int) -> int:
    """Split-K factor for decode: double while the grid is under ~3 programs per SM and every
    partition of a full-width (``max_ctx``) context keeps at least four key tiles; at most 64."""
    tiles = triton.cdiv(max(max_ctx, 1), block_n)
    parts = 1
    while batch * num_kv_heads * parts < 3 * sms and parts * 8 <= tiles and parts < 64:
        parts *= 2
    return parts


SPLIT_QMAX = 64  # longest rows whose key range a prefill launch splits (verify rows, short chunks)


def prefill_partitions(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_ctx: int, block_n: int, sms: int
) -> int:
    """Split-K factor of a prefill launch: short rows (speculative verification's 1 + K
    tokens, the mixed graphs' chunks of <= ``SPLIT_QMAX``) over long contexts leave most SMs
    idle at one partition, one program per (sequence, KV head) walking every key tile in turn.
    They split while the live programs (one per sequence, KV head and partition: the query
    tiles past a short row's end return at once) stay within one wave of the SMs, each
    partition of a full-width context keeping at least four key tiles; longer rows: one.

    Measured on sm_90 (``benchmarks/verify_attention.py``, 8 KV heads, rows of 5, ctx 512 and
    2048): 16 / 8 / 4 / 2 partitions were the fastest at 1 / 2 / 4 / 8 sequences, i.e. about
    128 programs on 132 SMs; decode's three waves (``decode_partitions``) were 1.6-1.8 x
    slower at 4-8 sequences."""
    if max_query_len > SPLIT_QMAX:
        return 1
    tiles = triton.cdiv(max(max_ctx, 1), block_n)
    parts = 1
    while 2 * num_seqs * num_kv_heads * parts <= sms and parts * 8 <= tiles and parts < 64:
        parts *= 2
    return parts


def decode_tiles(
    batch: int,
    num_kv_heads: int,
    max_ctx: int,
    sms: int,
    head_dim: int = 128,
    fp32: bool = False,
    device: torch.device | str | None = None,
) -> tuple[int, int]:
    """(key tile, partitions) of a decode launch on ``device`` (None: the generic rows):
    ``DECODE_TILES``, partitions by ``decode_partitions`` where the row leaves them open."""
    half_waves = 2 * batch * num_kv_heads // sms
    tiles = DECODE_TILES.pick(device, fp32=int(fp32), head_dim=head_dim, half_waves=half_waves)
    parts = tiles.parts or decode_partitions(batch, num_kv_heads, max_ctx, tiles.block_n, sms)
    return tiles.block_n, parts


def _launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None,
    block_tables: torch.Tensor, qsl: torch.Tensor | None, ctx: torch.Tensor, max_query_len: int,
    scale: float, window: int | None, tiles: tuple[int | None, int | None, int | None],
    fp32_precision: str,
) -> torch.Tensor:  # fmt: skip
    """Check, pick ``tiles`` = (block_m, block_n, partitions) where None, launch; decode when
    ``qsl`` is None."""
    out = torch.empty_like(q) if out is None else out
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if k_cache.shape != v_cache.shape or q.dtype != k_cache.dtype or d != k_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} vs cache {tuple(k_cache.shape)}")
    if hq % hkv:
        raise ValueError(f"{hq} query heads is not a multiple of {hkv} kv heads")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} for q {tuple(q.shape)}")
    if any(x.stride(-1) != 1 for x in (q, out, k_cache, v_cache)):
        raise ValueError("q, out and the caches need a contiguous head dimension")
    num_seqs = ctx.shape[0]
    if t == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    groups, g_pad = hq // hkv, triton.next_power_of_2(hq // hkv)
    fp32 = q.element_size() > 2
    block_m, block_n, parts = tiles
    max_ctx = block_tables.shape[1] * bs
    if qsl is None:
        sms = device_sms(q.device)
        # a row that sets the partitions too (the wide tile) only where the caller set neither
        half_waves = 2 * num_seqs * hkv // sms if block_n is None and parts is None else 0
        row = DECODE_TILES.pick(q.device, fp32=int(fp32), head_dim=d, half_waves=half_waves)
        block_n = block_n or row.block_n
        if parts is None:
            parts = row.parts or decode_partitions(num_seqs, hkv, max_ctx, block_n, sms)
        block_m = max(16, g_pad)
    else:
        row = PREFILL_TILES.pick(q.device, fp32=int(fp32), head_dim=d)
        block_n = block_n or row.block_n
        if block_m is None:
            block_m = min(row.block_m, triton.next_power_of_2(max_query_len * g_pad))
        block_m = max(block_m, g_pad, 16)
        if parts is None:
            sms = device_sms(q.device)
            parts = prefill_partitions(num_seqs, hkv, max_query_len, max_ctx, block_n, sms)
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot's K (q @ k) and N (p @ v) are >= 16
    part = ml = out  # unused when parts == 1
    if parts > 1:
        part = torch.empty(t, hq, parts, block_d, dtype=torch.float32, device=q.device)
        ml = torch.empty(t, hq, parts, 2, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(max_query_len, block_m // g_pad), num_seqs, hkv * parts)
    _attn_kernel[grid](
        q, k_cache, v_cache, out, part, ml, block_tables, ctx if qsl is None else qsl, ctx,
        scale * _LOG2E, window or 0, hq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUPS=groups, G_PAD=g_pad, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_PARTS=parts, IS_DECODE=qsl is None,
        USE_WINDOW=window is not None, FP32_PRECISION=fp32_precision,
        num_warps=8 if block_m >= 128 else 4,
    )  # fmt: skip
    if parts > 1:
        _merge_kernel[(t, hq)](
            out, part, ml, hq, out.stride(0), out.stride(1), HEAD_DIM=d, BLOCK_D=block_d,
            NUM_PARTS=parts, P_PAD=max(triton.next_power_of_2(parts), 2), num_warps=4,
        )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_partitions: int | None = None,
    block_n: int | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """One query per sequence: ``q[i]`` (Hq, D) sits at position ``context_lens[i] - 1``.

    ``block_tables`` (B, max_blocks) int32 and ``context_lens`` (B,) int32 live on the device;
    rows with ``context_lens[i] == 0`` get zeros. Graph-capturable: the launch depends only on
    B, the head counts and ``max_blocks``. ``num_partitions`` overrides ``decode_partitions``.
    """
    if q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"{q.shape[0]} query rows for {context_lens.shape[0]} sequences")
    tiles = (None, block_n, num_partitions)
    return _launch(q, k_cache, v_cache, out, block_tables, None, context_lens, 1, scale,
                   sliding_window, tiles, fp32_precision)  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_partitions: int | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """Causal attention of the flat batch q (T, Hq, D): sequence ``i`` owns rows
    ``query_start_loc[i]:query_start_loc[i+1]`` (int32, device), its last ``n_i`` context tokens.

    ``max_query_len`` (host int, >= every n_i) sizes the grid; ``block_m`` counts rows, i.e.
    queries x padded query heads per KV head. ``num_partitions`` splits every key range as
    decode does (None: ``prefill_partitions``).
    """
    tiles = (block_m, block_n, num_partitions)
    return _launch(q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens,
                   max_query_len, scale, sliding_window, tiles, fp32_precision)  # fmt: skip


class PagedInputs(NamedTuple):
    query_start_loc: torch.Tensor  # (B+1,) int32, device
    context_lens: torch.Tensor  # (B,) int32, device
    max_query_len: int


def device_tensors(meta: AttentionMetadata, device: torch.device) -> PagedInputs:
    """The kernels' inputs from ``meta``: its ``query_start_loc_t`` / ``context_lens_t`` /
    ``max_query_len`` when present, otherwise built from the host lists (one H2D copy each,
    not graph-capturable)."""
    qsl = getattr(meta, "query_start_loc_t", None)
    if qsl is None:
        qsl = torch.tensor(meta.query_start_loc, dtype=torch.int32).to(device, non_blocking=True)
    ctx = getattr(meta, "context_lens_t", None)
    if ctx is None:
        ctx = torch.tensor(meta.context_lens, dtype=torch.int32).to(device, non_blocking=True)
    max_q = getattr(meta, "max_query_len", None)
    if not max_q:  # None, or an unset 0
        starts = meta.query_start_loc
        max_q = max((b - a for a, b in zip(starts[:-1], starts[1:], strict=True)), default=0)
    return PagedInputs(qsl, ctx, int(max_q))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Drop-in for ``paged_attention_reference``: the decode kernel when ``meta.is_decode``
    (one row per sequence), the prefill kernel otherwise; CPU tensors without the Triton
    interpreter (the fused forward's twins on a host with CUDA) take the reference itself."""
    if not triton_reaches(q):
        ref = paged_attention_reference(q, k_cache, v_cache, meta, scale, sliding_window)
        return ref if out is None else out.copy_(ref)
    inputs = device_tensors(meta, q.device)
    if meta.is_decode:
        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, inputs.context_lens, scale, sliding_window, out
        )
    return paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, inputs.query_start_loc, inputs.context_lens,
        inputs.max_query_len, scale, sliding_window, out,
    )  # fmt: skip
