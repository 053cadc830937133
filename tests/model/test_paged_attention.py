"""Triton paged attention (decode split-K + prefill) vs ``paged_attention_reference``.

Without CUDA the kernels run through the interpreter (set before the kernels are imported);
the GPU-marked cases run compiled, in bfloat16, at Llama-3-8B decode shapes. Every cache slot
that holds no live token is NaN, so a kernel that reads one (or lets 0 * NaN through) fails.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    # Kernels decorated before the variable was set would be compiled ones: decorate again.
    if "loraplex.engine.model.paged_attention" in sys.modules:
        importlib.reload(sys.modules["loraplex.engine.model.paged_attention"])

import pytest  # noqa: E402

from loraplex.engine.model import paged_attention as pa  # noqa: E402
from loraplex.engine.model.attention import (  # noqa: E402
    AttentionMetadata,
    paged_attention_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's bfloat16 tl.dot is broken: bfloat16 only on a GPU.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1e-2}
DECODE_CTX = [1, 5, 16, 33, 64, 100, 0]  # 0: a padded row
# (context length, new tokens): prefix + chunk, whole prompts, single tokens, an empty row
PREFILL = [(1, 1), (16, 16), (40, 7), (100, 33), (17, 1), (64, 64), (30, 0), (48, 16)]


class Case:
    """Random q and a paged cache whose blocks are scattered; dead slots are NaN."""

    def __init__(self, ctxs: list[int], ns: list[int], hkv: int, groups: int, d: int,
                 bs: int, dtype: torch.dtype, seed: int = 0) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        need = [-(-c // bs) for c in ctxs]
        width = max(need) + 2  # extra padded columns, as the runner's tables have
        num_blocks = sum(need) + 5
        perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0: padding
        tables = torch.zeros(len(ctxs), width, dtype=torch.int32)
        live = torch.zeros(num_blocks, bs, dtype=torch.bool)
        for i, (c, nb) in enumerate(zip(ctxs, need, strict=True)):
            blocks = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.long)
            tables[i, :nb] = blocks.int()
            pos = torch.arange(c)
            live[blocks[pos // bs], pos % bs] = True
        shape = (num_blocks, bs, hkv, d)
        self.k = torch.randn(*shape, generator=g)
        self.v = torch.randn(*shape, generator=g)
        self.k[~live], self.v[~live] = float("nan"), float("nan")
        self.q = torch.randn(sum(ns), hkv * groups, d, generator=g)
        self.k, self.v, self.q = (t.to(DEVICE, dtype) for t in (self.k, self.v, self.q))
        qsl = [0]
        for n in ns:
            qsl.append(qsl[-1] + n)
        self.meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=DEVICE),
            block_tables=tables.to(DEVICE),
            query_start_loc=qsl,
            context_lens=ctxs,
            block_size=bs,
            is_decode=all(n == 1 for n in ns),
        )
        self.ctx_t = torch.tensor(ctxs, dtype=torch.int32, device=DEVICE)
        self.qsl_t = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        self.scale = d**-0.5

    def reference(self, window: int | None = None) -> torch.Tensor:
        """fp32 reference from the same (rounded) inputs; zeros for rows without keys."""
        f = (self.q.float(), self.k.float(), self.v.float())
        live = [i for i, c in enumerate(self.meta.context_lens) if c > 0]
        out = torch.zeros_like(f[0])
        if live:
            qsl = self.meta.query_start_loc
            rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in live]).to(DEVICE)
            sub = AttentionMetadata(
                self.meta.slot_mapping,
                self.meta.block_tables[live],
                [0] + torch.tensor([qsl[i + 1] - qsl[i] for i in live]).cumsum(0).tolist(),
                [self.meta.context_lens[i] for i in live],
                self.meta.block_size,
            )
            out[rows] = paged_attention_reference(f[0][rows], f[1], f[2], sub, self.scale, window)
        return out


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("bs", [4, 16])
def test_decode(dtype: torch.dtype, groups: int, bs: int) -> None:
    c = Case(DECODE_CTX, [1] * len(DECODE_CTX), 4 // groups, groups, 32, bs, dtype)
    ref = c.reference()
    for parts in (1, 3):
        out = pa.paged_decode_attention(
            c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale, num_partitions=parts, block_n=16
        )
        _check(out, ref, dtype)
        assert not out[-1].any()  # the padded row


@pytest.mark.parametrize("window", [1, 5, 16, 17, 200])
def test_decode_sliding_window(window: int) -> None:
    c = Case(DECODE_CTX, [1] * len(DECODE_CTX), 2, 2, 32, 4, torch.float32, seed=window)
    ref = c.reference(window)
    for parts in (1, 4):
        out = pa.paged_decode_attention(
            c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale, window, num_partitions=parts,
            block_n=8,
        )  # fmt: skip
        _check(out, ref, torch.float32)


def test_decode_default_config_odd_head_dim() -> None:
    c = Case([3, 70, 0, 129], [1] * 4, 1, 4, 40, 16, torch.float16, seed=3)
    out = pa.paged_decode_attention(c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale)
    _check(out, c.reference(), torch.float16)


@pytest.mark.parametrize("decode", [True, False])
def test_head_dim_below_16(decode: bool) -> None:
    """A head dimension of 8 (tiny draft models): the tile's head dimension is padded to 16,
    since a compiled tl.dot needs K and N >= 16 (the interpreter does not; this fails only on a
    GPU without the padding)."""
    ns = [1] * 4 if decode else [5, 1, 0, 9]
    c = Case([8, 70, 0, 40], ns, 2, 2, 8, 16, torch.float32, seed=5)
    if decode:
        out = pa.paged_decode_attention(c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale)
    else:
        out = pa.paged_prefill_attention(
            c.q, c.k, c.v, c.meta.block_tables, c.qsl_t, c.ctx_t, max(ns), c.scale
        )
    _check(out, c.reference(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("bs", [4, 16])
def test_prefill(dtype: torch.dtype, groups: int, bs: int) -> None:
    ctxs, ns = zip(*PREFILL, strict=True)
    c = Case(list(ctxs), list(ns), 4 // groups, groups, 32, bs, dtype, seed=groups)
    ref = c.reference()
    tiles = [(16, 16, 1), (None, None, None)]
    if dtype == torch.float32:  # key ranges split across causal rows (the interpreter is slow)
        tiles.append((16, 8, 3))
    for block_m, block_n, parts in tiles:
        out = pa.paged_prefill_attention(
            c.q, c.k, c.v, c.meta.block_tables, c.qsl_t, c.ctx_t, max(ns), c.scale,
            block_m=block_m, block_n=block_n, num_partitions=parts,
        )  # fmt: skip
        _check(out, ref, dtype)


@pytest.mark.parametrize("parts", [2, 5])
def test_prefill_split_keys_verify_rows(parts: int) -> None:
    """Rows of 1 + K tokens over long contexts (speculative verification) with the key range
    split: partitions that hold no key a row may see (causal, or past the context) add
    nothing; a grid sized for longer rows (the mixed graphs' fixed ``max_query_len``)."""
    ctxs, ns = [70, 5, 33, 1, 100], [5, 5, 1, 1, 3]
    c = Case(ctxs, ns, 2, 4, 32, 4, torch.float32, seed=parts)
    for window in (None, 9):
        out = pa.paged_prefill_attention(
            c.q, c.k, c.v, c.meta.block_tables, c.qsl_t, c.ctx_t, 16, c.scale, window,
            block_n=8, num_partitions=parts,
        )  # fmt: skip
        _check(out, c.reference(window), torch.float32)


def test_prefill_partitions_heuristic() -> None:
    # short rows split until about one program per SM (the fastest on sm_90); long rows do not
    assert [pa.prefill_partitions(s, 8, 5, 4096, 64, 132) for s in (1, 2, 4, 8, 16)] == [
        16, 8, 4, 2, 1,
    ]  # fmt: skip
    assert pa.prefill_partitions(1, 8, 64, 4096, 64, 132) == 16
    assert pa.prefill_partitions(1, 8, 65, 4096, 64, 132) == 1
    assert pa.prefill_partitions(1, 8, 5, 256, 64, 132) == 1  # four key tiles: kept whole
    assert pa.prefill_partitions(1, 8, 5, 1024, 64, 132) == 4  # 16 tiles: 4 a partition


@pytest.mark.parametrize("window", [1, 8, 20])
def test_prefill_sliding_window(window: int) -> None:
    ctxs, ns = zip(*PREFILL, strict=True)
    c = Case(list(ctxs), list(ns), 2, 2, 32, 4, torch.float32, seed=window)
    out = pa.paged_prefill_attention(
        c.q, c.k, c.v, c.meta.block_tables, c.qsl_t, c.ctx_t, max(ns), c.scale, window,
        block_m=16, block_n=8,
    )  # fmt: skip
    _check(out, c.reference(window), torch.float32)


@pytest.mark.parametrize("decode", [True, False])
def test_dispatcher_strided_q_and_out(decode: bool) -> None:
    ctxs, ns = ([9, 31, 16], [1, 1, 1]) if decode else ([9, 31, 16], [9, 4, 1])
    c = Case(ctxs, ns, 2, 2, 32, 4, torch.float32, seed=7)
    assert c.meta.is_decode == decode
    # q as a column window of a fused qkv tensor; out as a column window of a wider buffer
    qkv = torch.randn(c.q.shape[0], 8, 32, device=DEVICE)
    qkv[:, 2:6] = c.q
    q = qkv[:, 2:6]
    buf = torch.full((c.q.shape[0], 6, 32), 7.0, device=DEVICE)
    out = pa.paged_attention(q, c.k, c.v, c.meta, c.scale, out=buf[:, 1:5])
    assert out.data_ptr() == buf[:, 1:5].data_ptr()
    _check(out, c.reference(), torch.float32)
    assert (buf[:, 0] == 7).all() and (buf[:, 5] == 7).all()


def test_device_tensors_prefers_meta_fields() -> None:
    c = Case([5, 9], [2, 3], 1, 1, 16, 4, torch.float32)
    inp = pa.device_tensors(c.meta, torch.device(DEVICE))
    assert inp.query_start_loc.tolist() == [0, 2, 5] and inp.context_lens.tolist() == [5, 9]
    assert inp.max_query_len == 3 and inp.context_lens.dtype == torch.int32
    c.meta.context_lens_t = c.ctx_t  # type: ignore[attr-defined]
    c.meta.max_query_len = 4  # type: ignore[attr-defined]
    inp = pa.device_tensors(c.meta, torch.device(DEVICE))
    assert inp.context_lens is c.ctx_t and inp.max_query_len == 4


def test_decode_partitions_heuristic() -> None:
    assert pa.decode_partitions(256, 8, 4096, 64, 132) == 1
    assert pa.decode_partitions(1, 8, 4096, 64, 132) == 16  # 64 tiles: >= 4 tiles / partition
    assert pa.decode_partitions(1, 8, 1 << 20, 64, 132) == 64
    assert pa.decode_partitions(16, 8, 4096, 64, 132) == 4
    assert pa.decode_partitions(4, 8, 64, 64, 132) == 1


def test_decode_tiles_heuristic() -> None:
    assert pa.decode_tiles(32, 8, 4096, 132) == (128, 1)  # 256 programs: ~2 per SM, unsplit
    assert pa.decode_tiles(25, 8, 4096, 132) == (128, 1)
    assert pa.decode_tiles(24, 8, 4096, 132) == (64, 4)  # under 1.5 per SM: split as before
    assert pa.decode_tiles(49, 8, 4096, 132) == (128, 1)
    assert pa.decode_tiles(50, 8, 4096, 132) == (64, 1)  # 400 programs: 3 per SM already
    assert pa.decode_tiles(16, 8, 4096, 132) == (64, 4)
    assert pa.decode_tiles(64, 4, 4096, 132) == (128, 1)  # 4 KV heads (Qwen2-style)


def test_decode_wide_tiles_by_default(monkeypatch) -> None:
    """The default config at about two programs per SM (device_sms patched small): 128-key
    tiles, one partition, over contexts of several tiles and none; a caller's key tile wins."""
    c = Case([300, 3, 129, 0, 257], [1] * 5, 1, 4, 32, 16, torch.float16, seed=7)
    monkeypatch.setattr(pa, "device_sms", lambda device: 3)  # 5 programs: 1.5-3 x 3 SMs
    launched = []
    real = pa._attn_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launched.append((kw["BLOCK_N"], kw["NUM_PARTS"]))
                return real[grid](*args, **kw)

            return run

    monkeypatch.setattr(pa, "_attn_kernel", Spy())
    out = pa.paged_decode_attention(c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale)
    _check(out, c.reference(), torch.float16)
    assert launched == [(128, 1)]
    pa.paged_decode_attention(c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale, block_n=64)
    assert launched[1][0] == 64


def test_shape_errors() -> None:
    c = Case([5], [1], 2, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        pa.paged_decode_attention(c.q[:, :3], c.k, c.v, c.meta.block_tables, c.ctx_t, 1.0)
    with pytest.raises(ValueError, match="cache"):
        pa.paged_decode_attention(c.q.half(), c.k, c.v, c.meta.block_tables, c.ctx_t, 1.0)


# ---------------------------------------------------------------- GPU (compiled, bfloat16)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 32, 64, 256])
def test_decode_llama3_shapes_gpu(batch: int) -> None:
    g = torch.Generator().manual_seed(batch)
    longest = 4096 if batch <= 64 else 1024  # host memory of the random cache
    ctxs = torch.randint(1, longest + 1, (batch,), generator=g).tolist()
    if batch > 1:
        ctxs[-1], ctxs[0] = 0, 512  # a padded row, an exact block multiple
    c = Case(ctxs, [1] * batch, 8, 4, 128, 16, torch.bfloat16, seed=batch)
    ref = c.reference()
    for parts in (None, 1, 8):
        out = pa.paged_decode_attention(
            c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale, num_partitions=parts
        )
        assert not out.isnan().any() and _rel_err(out, ref) < 1e-2
    out = pa.paged_decode_attention(c.q, c.k, c.v, c.meta.block_tables, c.ctx_t, c.scale, 1024)
    assert _rel_err(out, c.reference(1024)) < 1e-2


@pytest.mark.gpu
def test_decode_cuda_graph_replay_gpu() -> None:
    ctxs = [700, 1, 2048, 33]
    c = Case(ctxs, [1] * 4, 8, 4, 128, 16, torch.bfloat16)
    ctx_t = c.ctx_t.clone()
    out = torch.empty_like(c.q)
    pa.paged_decode_attention(c.q, c.k, c.v, c.meta.block_tables, ctx_t, c.scale, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode_attention(c.q, c.k, c.v, c.meta.block_tables, ctx_t, c.scale, out=out)
    for new in ([700, 1, 2048, 33], [5, 0, 1000, 33]):
        ctx_t.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        c.meta.context_lens = new
        assert _rel_err(out, c.reference()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 300])
def test_prefill_llama3_shapes_gpu(window: int | None) -> None:
    seqs = [(1000, 1000), (1500, 300), (700, 1), (2048, 64), (17, 17)]
    c = Case([s[0] for s in seqs], [s[1] for s in seqs], 8, 4, 128, 16, torch.bfloat16)
    out = pa.paged_attention(c.q, c.k, c.v, c.meta, c.scale, window)
    assert not out.isnan().any() and _rel_err(out, c.reference(window)) < 1e-2


@pytest.mark.gpu
def test_prefill_verify_rows_llama3_shapes_gpu() -> None:
    """Verification rows (1 + 4 tokens) at long contexts in a grid sized for 64-token rows, as
    the mixed graphs launch it: split by ``prefill_partitions``, and unsplit."""
    seqs = [(700, 5), (2048, 5), (33, 1), (4000, 5), (517, 5)]
    c = Case([s[0] for s in seqs], [s[1] for s in seqs], 8, 4, 128, 16, torch.bfloat16)
    ref = c.reference()
    for parts in (None, 1):
        out = pa.paged_prefill_attention(
            c.q, c.k, c.v, c.meta.block_tables, c.qsl_t, c.ctx_t, 64, c.scale, num_partitions=parts
        )
        assert not out.isnan().any() and _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("ns", [[1, 1, 1], [3, 1, 7]])
def test_cpu_tensors_without_the_interpreter_take_the_reference(monkeypatch, ns) -> None:
    """The fused forward's twins on CPU tensors where Triton is not interpreted (a host with
    CUDA): ``paged_attention`` computes the reference itself and launches nothing."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def no_launch(*args, **kwargs):
        raise AssertionError("a Triton launch on CPU tensors")

    monkeypatch.setattr(pa, "_launch", no_launch)
    g = torch.Generator().manual_seed(5)
    ctxs, bs, hkv, d = [9, 4, 12], 4, 2, 16
    k = torch.randn(12, bs, hkv, d, generator=g)
    v = torch.randn(12, bs, hkv, d, generator=g)
    q = torch.randn(sum(ns), hkv * 2, d, generator=g)
    tables = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 7]], dtype=torch.int32)
    qsl = [0, ns[0], ns[0] + ns[1], sum(ns)]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), tables, qsl, ctxs, bs,
                             is_decode=all(n == 1 for n in ns))  # fmt: skip
    want = paged_attention_reference(q, k, v, meta, 0.25)
    assert torch.equal(pa.paged_attention(q, k, v, meta, 0.25), want)
    out = torch.full_like(q, 7.0)
    assert pa.paged_attention(q, k, v, meta, 0.25, out=out) is out
    assert torch.equal(out, want)
