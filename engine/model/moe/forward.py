"""The GPU forward of the MoE families: ``fused.py``'s attention and epilogues around the
experts' grouped GEMM.

Per decoder layer::

    qkv_aug = h @ [Wqkv; A_qkv].T                     augmented GEMM (base + every slot's shrink)
    (Qwen3) qkv = qk_norm(qkv_aug)                    + LoRA delta, per-head q / k RMSNorm
    q       = qkv_rope(qkv or qkv_aug)                RoPE, K / V into the cache (+ LoRA delta
                                                       where no qk_norm added it)
    attn    = paged_attention(q, cache)
    o_aug   = attn @ [Wo; A_o].T
    h       = add_rmsnorm(o_aug, residual)            + LoRA delta, residual add, RMSNorm
    sparse: d = experts(h)                            router GEMM, top-k, sort by expert,
                                                       grouped GEMM gate_up (+ expert LoRA),
                                                       SiLU * up, grouped GEMM down (+ expert
                                                       LoRA, x routing weight), sum over k
    dense:  d = down(silu_mul(gate_up(h)))            as fused.py (Qwen3-MoE's dense layers)
    (next layer's add_rmsnorm takes d)

Every shape depends on T (the sorted-pair buffers on T * k, E and the block size), no host
sync: a decode step is captured in a CUDA graph as the dense families' are. ``triton=False``
runs the epilogues and the grouped GEMM as their torch twins (CPU tests). Not here: tensor
parallelism (refused for MoE models).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from loraplex.engine.model.attention import AttentionMetadata
from loraplex.engine.model.fused import _dora, _linear
from loraplex.engine.model.kernels import lora_add_rmsnorm, lora_qkv_rope, lora_silu_mul, rmsnorm
from loraplex.engine.model.kernels.qk_norm import lora_qk_norm
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.paged_attention import paged_attention
from loraplex.engine.model.protocol import CausalLM

__all__ = ["moe_fused_forward"]


def moe_fused_forward(
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
    """``fused.fused_forward``'s contract for a ``MoeForCausalLM`` (``moe/model.py``, which
    calls this: typed by the protocol, no import back): input_ids, positions, token_slots (T,)
    -> final normed hidden states (T, H)."""
    cfg = model.cfg
    t = input_ids.shape[0]
    eps = cfg.rms_norm_eps
    layers = model.layers
    mapping = LoRAMapping(token_slots, triton=triton, dora=dora, rank_bound=rank_bound)
    full = model.full_modules  # modules_to_save tables (lora/full.py)
    ids = full.base_ids(input_ids) if full is not None and full.extra else input_ids
    residual = F.embedding(ids, model.embed_tokens)  # updated in place by add_rmsnorm
    embed_lora = model.lora_vocab().get("embed_tokens")
    if embed_lora is not None:
        embed_lora.add(residual, ids, token_slots, triton=triton)
    if full is not None:
        full.embed_rows(residual, input_ids, token_slots)
    h = torch.empty_like(residual)
    rmsnorm(residual, layers[0].input_layernorm.weight, eps, h, triton=triton)
    q = torch.empty(t, cfg.num_heads, cfg.head_dim, dtype=h.dtype, device=h.device)
    qkv_n = None  # the q / k-normalised projection (Qwen3), one buffer for every layer
    if cfg.qk_norm:
        n = cfg.q_size + 2 * cfg.kv_size
        qkv_n = torch.empty(t, n, dtype=h.dtype, device=h.device)
    act = None  # a dense layer's SiLU * up
    for i, layer in enumerate(layers):
        k_cache, v_cache = kv_caches[i]
        qkv_proj = layer.qkv_proj
        qkv = _linear(h, qkv_proj, mapping)
        lora, qkv_dora = qkv_proj.lora_b, _dora(qkv_proj, dora)
        if qkv_n is not None:
            assert layer.q_norm is not None and layer.k_norm is not None
            lora_qk_norm(
                qkv, lora, mapping, layer.q_norm.weight, layer.k_norm.weight, eps, qkv_n,
                cfg.num_heads, qkv_dora,
            )  # fmt: skip
            qkv, lora, qkv_dora = qkv_n, None, None  # the delta is in
        lora_qkv_rope(
            qkv, lora, mapping, positions=positions, cos=model.rope.cos, sin=model.rope.sin,
            k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping, q_out=q,
            dora=qkv_dora,
        )  # fmt: skip
        attn = attention(q, k_cache, v_cache, meta, layer.scale, cfg.sliding_window)
        o = _linear(attn.view(t, cfg.q_size), layer.o_proj, mapping)
        lora_add_rmsnorm(
            o, residual, layer.o_proj.lora_b, mapping,
            norm_weight=layer.post_attention_layernorm.weight, eps=eps, out=h,
            dora=_dora(layer.o_proj, dora),
        )  # fmt: skip
        if layer.mlp is not None:
            d = layer.mlp(h, triton=triton, token_slots=token_slots)
            down_b, down_dora = None, None
        else:
            gate_up, down = layer.gate_up_proj, layer.down_proj
            assert gate_up is not None and down is not None
            if act is None:
                act = torch.empty(t, cfg.intermediate_size, dtype=h.dtype, device=h.device)
            gu = _linear(h, gate_up, mapping)
            lora_silu_mul(gu, gate_up.lora_b, mapping, out=act, dora=_dora(gate_up, dora))
            d, down_b, down_dora = _linear(act, down, mapping), down.lora_b, _dora(down, dora)
        norm_w = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else model.norm.weight
        lora_add_rmsnorm(
            d, residual, down_b, mapping, norm_weight=norm_w, eps=eps, out=h, dora=down_dora
        )
    return h
