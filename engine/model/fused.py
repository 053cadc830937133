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

The model must have the Llama layer structure; this forward reads ``embed_tokens``, ``norm``,
``rope`` (``cos``, ``sin``) and per layer ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj`` (``LoRALinear``: ``weight_aug``, ``bias_aug``, ``lora_b``), ``input_layernorm``,
``post_attention_layernorm`` and ``scale``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from loraplex.engine.model.attention import AttentionMetadata
from loraplex.engine.model.gemm import linear
from loraplex.engine.model.kernels import lora_add_rmsnorm, lora_qkv_rope, lora_silu_mul, rmsnorm
from loraplex.engine.model.lora.layers import LoRALinear
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
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
) -> torch.Tensor:
    """input_ids, positions, token_slots: (T,). Returns final normed hidden states (T, H).

    ``attention``: ``paged_attention``'s signature; mixed-step graphs pass their own split.
    ``triton``: the epilogues as Triton kernels, else as their torch twins.
    ``dora``: the epilogues apply the DoRA row scale (model/lora/dora.py; B already holds it) to the
    base output of rows whose slot holds a DoRA adapter before they add the delta (a flag per
    slot and projection, read in the kernels: the decode graphs are captured with it, eager
    steps set it only when some row needs it). Not under tensor parallelism (refused there).
    ``rank_bound``: every row's adapter has rank <= it: the GEMMs read only the A rows of
    ranks below it and the epilogues loop over as many (model/lora/ranks.py); None: all rows."""
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
        qkv = _linear(h, layer.qkv_proj, mapping)
        lora_qkv_rope(
            qkv, layer.qkv_proj.lora_b, mapping, positions=positions, cos=model.rope.cos,
            sin=model.rope.sin, k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping,
            q_out=q, dora=_dora(layer.qkv_proj, dora),
        )  # fmt: skip
        attn = attention(q, k_cache, v_cache, meta, layer.scale, cfg.sliding_window)
        o = _linear(attn.view(t, cfg.q_size), layer.o_proj, mapping)
        if tp is not None:  # base and shrink partials in one all-reduce, then the epilogue
            tp.all_reduce(o)
        lora_add_rmsnorm(
            o, residual, layer.o_proj.lora_b, mapping,
            norm_weight=layer.post_attention_layernorm.weight, eps=eps, out=h,
            dora=_dora(layer.o_proj, dora),
        )  # fmt: skip
        gu = _linear(h, layer.gate_up_proj, mapping)
        gate_up_b = layer.gate_up_proj.lora_b
        lora_silu_mul(gu, gate_up_b, mapping, out=act, dora=_dora(layer.gate_up_proj, dora))
        d = _linear(act, layer.down_proj, mapping)
        if tp is not None:
            tp.all_reduce(d)
        norm_w = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.norm.weight
        lora_add_rmsnorm(
            d, residual, layer.down_proj.lora_b, mapping, norm_weight=norm_w, eps=eps, out=h,
            dora=_dora(layer.down_proj, dora),
        )  # fmt: skip
    return h
