"""The GPU forward: augmented GEMMs + fused Triton epilogues + paged attention.

Per decoder layer, eight launches and no separate LoRA launch:

    qkv_aug = h @ [Wqkv; A_qkv].T                     BLAS (fp8 base: kernels/fp8_linear.py):
                                                       base qkv + every slot's shrink
    q       = qkv_rope(qkv_aug)                        + LoRA delta, RoPE, K/V into the cache
    attn    = paged_attention(q, cache)
    o_aug   = attn @ [Wo; A_o].T
    h       = add_rmsnorm(o_aug, residual)             + LoRA delta, residual add, RMSNorm
    gu_aug  = h @ [Wgu; A_gu].T
    act     = silu_mul(gu_aug)                         + LoRA delta, SiLU(gate) * up
    d_aug   = act @ [Wd; A_d].T
    (next layer's add_rmsnorm takes d_aug)

The row -> adapter mapping is just ``token_slots`` (T,) int32 (-1 = base), wrapped once per
forward in the step's ``LoRAMapping`` (no segments, no host-side sizes), so the whole step can
be captured in a CUDA graph. ``triton=False`` runs the epilogues as their torch twins (tests on
CPU; paged attention stays Triton). Numerics follow the reference path (llama.py) and HF: the
kernels' torch twins pin them. DoRA rows (model/lora/dora.py) take their row scale inside the same
epilogues (``dora``), so graphs serve them with no extra launch.

The embedding LoRA (``lora_vocab()``, model/lora/vocab.py) is added to the embedded rows, and rows of
a slot with a full embedding table (``full_modules``, model/lora/full.py) take theirs; the LM head's
LoRA and full tables are the caller's (``compute_logits`` / the graphs), on the logits rows.

The side form (``side`` / ``LORAPLEX_LORA_SIDE``; default off): each projection's LoRA on a
side stream beside its base GEMM (``_Side``, ``_SideStream``), in steps of up to
``SIDE_MAX_TOKENS`` tokens.

The model must have the Llama layer structure; this forward reads ``embed_tokens``, ``norm``,
``rope`` (``cos``, ``sin``) and per layer ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj`` (``LoRALinear``: ``weight_aug``, ``bias_aug``, ``lora_b``), ``input_layernorm``,
``post_attention_layernorm`` and ``scale``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from loraplex.engine.model.attention import AttentionMetadata
from loraplex.engine.model.gemm import linear
from loraplex.engine.model.kernels import lora_add_rmsnorm, lora_qkv_rope, lora_silu_mul, rmsnorm
from loraplex.engine.model.lora.layers import LoRALinear
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
from loraplex.engine.model.lora.ops.expand_delta import lora_expand_delta
from loraplex.engine.model.paged_attention import paged_attention
from loraplex.engine.model.protocol import CausalLM

__all__ = ["fused_forward"]


def _linear(x: torch.Tensor, lin: LoRALinear, mapping: LoRAMapping) -> torch.Tensor:
    """(T, N_total + shrink columns): base output and every slot's shrink of the step's rank
    rows (``mapping.rank_bound``: a prefix of the rank-major A rows), one GEMM. An fp8 base
    (float rows dropped): the fp8 GEMM with the A rows in the same launch (the twin off CUDA
    or with ``triton=False``)."""
    w, bias = lin.aug_rows(mapping.rank_bound)
    if not lin.float_base:
        gemm = lin.fp8_gemm(x.shape[0], x.is_cuda and mapping.triton)
        rows = w if w.shape[0] else None
        return gemm(x, lin.weight_fp8, lin.weight_scale, rows, bias)
    return linear(x, w, bias)


def _dora(lin: LoRALinear, on: bool) -> DoraRows | None:
    return lin.dora_rows() if on else None


SIDE_MODES = ("0", "1")
# steps of at most this many tokens take the side form (decode: bound by bytes, not FLOPs;
# the side form's fp32 delta of gate_up is 0.11 MB a token)
SIDE_MAX_TOKENS = 256


def lora_side() -> str:
    """``LORAPLEX_LORA_SIDE``: ``1``, each projection's LoRA beside its base GEMM (``_Side``);
    ``0`` (default), inside the augmented GEMM and the epilogue. Read by the steps that ask for
    the environment's choice (the A/B switch of benchmarks/ab_env.sh; BENCHMARKS.md, "Mixed
    ranks and rank 64", has what it gains)."""
    raw = os.environ.get("LORAPLEX_LORA_SIDE", "0")
    if raw not in SIDE_MODES:
        raise ValueError(f"LORAPLEX_LORA_SIDE={raw!r}: one of {', '.join(SIDE_MODES)}")
    return raw


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


class _SideStream:
    """Work on a side stream beside the step's stream (in a CUDA graph, a parallel branch),
    joined back before what needs it; where there is no CUDA stream (CPU) in order."""

    def __init__(self, device: torch.device) -> None:
        self.stream = _side_stream(device) if device.type == "cuda" else None

    @contextmanager
    def beside(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class _Side:
    """Each projection's LoRA beside its GEMM on a side stream (``_SideStream``), joined before
    the epilogue: on the side stream the shrink, a GEMM of the step's A rows, and
    ``lora_expand_delta`` into an fp32 (T, N) buffer; on the step's stream the GEMM of the base
    rows alone; the epilogue reads the delta (``delta=``) instead of computing it. The delta's
    B reads (and the A rows') can then use the bandwidth the skinny base GEMM leaves. The same
    sums as the fused epilogues (per row, its slot's rank chunks in order)."""

    def __init__(self, side: _SideStream, mapping: LoRAMapping) -> None:
        self.side = side
        self.mapping = mapping

    def project(self, x: torch.Tensor, lin: LoRALinear) -> tuple[torch.Tensor, dict]:
        """The projection's output and its epilogue's LoRA arguments."""
        w, bias = lin.aug_rows(self.mapping.rank_bound)
        n = lin.out_features
        t = x.shape[0]
        # on the step's stream: freed there, after the join (no record_stream needed)
        shrink = torch.empty(t, w.shape[0] - n, dtype=x.dtype, device=x.device)
        delta = torch.empty(t, n, dtype=torch.float32, device=x.device)
        with self.side.beside():
            # A rows (no bias: bias_aug is 0 past N), by cuBLAS: not gemm.linear, whose tuned
            # choice may be the split-K Triton GEMM, whose counters the base GEMM beside it
            # may be using (fp8_linear.py: its launches must not overlap)
            torch.matmul(x, w[n:].t(), out=shrink)
            lora_expand_delta(shrink, lin.lora_b, self.mapping, lin.slice_offsets, delta)
        y = linear(x, w[:n], bias[:n] if bias is not None else None)
        self.side.join()
        return y, {"lora_b": None, "delta": delta}


def fused_forward(
    model: CausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
    token_slots: torch.Tensor,
    attention: Callable[..., torch.Tensor] = paged_attention,
    *,
    triton: bool = True,
    dora: bool = False,
    rank_bound: int | None = None,
    side: str | None = None,
) -> torch.Tensor:
    """input_ids, positions, token_slots: (T,). Returns final normed hidden states (T, H).

    ``attention``: ``paged_attention``'s signature; mixed-step graphs pass their own split.
    ``triton``: the epilogues as Triton kernels, else as their torch twins.
    ``dora``: the epilogues apply the DoRA row scale (model/lora/dora.py; B already holds it) to the
    base output of rows whose slot holds a DoRA adapter before they add the delta (a flag per
    slot and projection, read in the kernels: the decode graphs are captured with it, eager
    steps set it only when some row needs it). Not under tensor parallelism (refused there).
    ``rank_bound``: every row's adapter has rank <= it: the GEMMs read only the A rows of
    ranks below it and the epilogues loop over as many (model/lora/ranks.py); None: all rows.
    ``side``: ``"1"``, each projection's LoRA beside its base GEMM instead of inside the GEMM
    and the epilogue (``_Side``); ``"0"``, inside; None: the ``LORAPLEX_LORA_SIDE`` switch.
    Only steps of up to ``SIDE_MAX_TOKENS`` tokens, not for an fp8 base nor under tensor
    parallelism (those steps keep the fused form)."""
    own = getattr(model, "fused_forward", None)  # a family's own GPU forward (moe/forward.py)
    if own is not None:
        return own(
            input_ids, positions, kv_caches, meta, token_slots, attention,
            triton=triton, dora=dora, rank_bound=rank_bound,
        )  # fmt: skip
    cfg = model.cfg
    t = input_ids.shape[0]
    eps = cfg.rms_norm_eps
    layers = model.layers
    first = layers[0]
    # the step's LoRA metadata
    tp = getattr(model, "tp", None)  # a tensor-parallel shard (tp.py): o / down all-reduced
    dora = dora and tp is None
    mapping = LoRAMapping(token_slots, triton=triton, dora=dora, rank_bound=rank_bound)
    side = lora_side() if side is None else side
    if side not in SIDE_MODES:
        raise ValueError(f"side={side!r}: one of {', '.join(SIDE_MODES)}")
    beside = None
    lora_base = first.qkv_proj.lora_b is not None and first.qkv_proj.float_base
    decode_sized = t <= SIDE_MAX_TOKENS  # memory-bound steps; prefill keeps the fused form
    if side == "1" and tp is None and lora_base and decode_sized:
        beside = _Side(_SideStream(input_ids.device), mapping)

    def project(x: torch.Tensor, lin: LoRALinear) -> tuple[torch.Tensor, dict]:
        """The projection's output and its epilogue's LoRA arguments."""
        if beside is None or lin.lora_b is None:
            return _linear(x, lin, mapping), {"lora_b": lin.lora_b}
        return beside.project(x, lin)

    full = getattr(model, "full_modules", None)  # modules_to_save tables (model/lora/full.py)
    # ids of added tokens (full tables past the vocabulary) reach the base clamped
    ids = full.base_ids(input_ids) if full is not None and full.extra else input_ids
    if tp is not None:
        residual = tp.embed(ids, model.embed_tokens)
    else:
        residual = F.embedding(ids, model.embed_tokens)  # updated in place by add_rmsnorm
    # NOTE: a tensor-parallel shard takes no vocab LoRA (tp.shard_adapter refuses it)
    embed_lora = model.lora_vocab().get("embed_tokens") if tp is None else None
    if embed_lora is not None:  # base rows: a launch, no work (ops/triton_vocab.py)
        embed_lora.add(residual, ids, token_slots, triton=triton)
    if full is not None:
        full.embed_rows(residual, input_ids, token_slots)
    h = torch.empty_like(residual)
    rmsnorm(residual, first.input_layernorm.weight, eps, h, triton=triton)
    q = torch.empty(t, cfg.num_heads, cfg.head_dim, dtype=h.dtype, device=h.device)
    act = torch.empty(t, cfg.intermediate_size, dtype=h.dtype, device=h.device)
    for i, layer in enumerate(layers):
        k_cache, v_cache = kv_caches[i]
        qkv, lora = project(h, layer.qkv_proj)
        lora_qkv_rope(
            qkv, mapping=mapping, positions=positions, cos=model.rope.cos, sin=model.rope.sin,
            k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping, q_out=q,
            dora=_dora(layer.qkv_proj, dora), **lora,
        )  # fmt: skip
        attn = attention(q, k_cache, v_cache, meta, layer.scale, cfg.sliding_window)
        o, lora = project(attn.view(t, cfg.q_size), layer.o_proj)
        if tp is not None:  # base and shrink partials in one all-reduce, then the epilogue
            tp.all_reduce(o)
        lora_add_rmsnorm(
            o, residual, mapping=mapping, norm_weight=layer.post_attention_layernorm.weight,
            eps=eps, out=h, dora=_dora(layer.o_proj, dora), **lora,
        )  # fmt: skip
        gu, lora = project(h, layer.gate_up_proj)
        lora_silu_mul(gu, mapping=mapping, out=act, dora=_dora(layer.gate_up_proj, dora), **lora)
        d, lora = project(act, layer.down_proj)
        if tp is not None:
            tp.all_reduce(d)
        norm_w = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.norm.weight
        lora_add_rmsnorm(
            d, residual, mapping=mapping, norm_weight=norm_w, eps=eps, out=h,
            dora=_dora(layer.down_proj, dora), **lora,
        )  # fmt: skip
    return h
