"""Llama-family decoder (Llama incl. Llama-3 rope scaling, Mistral, Qwen2) with LoRA slots.

Projections are fused (qkv, gate_up) for one base GEMM each; LoRA still applies per original
module because each fused layer keeps one slice per module. The forward works on a flat batch
of T tokens from many sequences (varlen), reading and writing a paged KV cache.

``FAMILY`` is what the registry serves for Llama, Mistral and Qwen2: this class and
``LlamaWeights``, the map from HF checkpoint keys to its (fused) tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from loraplex.engine.model.attention import (
    AttentionMetadata,
    paged_attention_batched,
    write_kv,
)
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.loader import ModelLoadError
from loraplex.engine.model.lora.full import FullModules
from loraplex.engine.model.lora.layers import LoRALinear
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.lora.vocab import VocabLoRA
from loraplex.engine.model.registry import ModelFamily
from loraplex.engine.model.rope import RotaryEmbedding, apply_rotary
from loraplex.engine.model.tp import TensorParallel

__all__ = ["LlamaForCausalLM", "LlamaWeights", "RMSNorm", "FAMILY"]


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(size, dtype=dtype, device=device), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one kernel; the same values as the lines below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, lora_kw: dict, dtype: torch.dtype, device) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.qkv_proj = LoRALinear(
            h,
            {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size},
            bias=cfg.qkv_bias,
            **lora_kw,
        )
        self.o_proj = LoRALinear(cfg.q_size, {"o_proj": h}, bias=cfg.o_bias, **lora_kw)
        self.gate_up_proj = LoRALinear(
            h,
            {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
            bias=cfg.mlp_bias,
            **lora_kw,
        )
        self.down_proj = LoRALinear(
            cfg.intermediate_size, {"down_proj": h}, bias=cfg.mlp_bias, **lora_kw
        )
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.scale = cfg.head_dim**-0.5
        self.tp: TensorParallel | None = None  # a shard of a tensor-parallel model (tp.py)

    def lora_linears(self) -> dict[str, LoRALinear]:
        """Original module name -> the fused layer holding its slice."""
        out: dict[str, LoRALinear] = {}
        for layer in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj):
            for name in layer.slice_names:
                out[name] = layer
        return out

    def forward(
        self,
        x: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        mapping: LoRAMapping | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``rope``: (cos, signed_sin) of the step's positions (``RotaryEmbedding.table``)."""
        cfg = self.cfg
        t = x.shape[0]
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h, mapping)
        qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = apply_rotary(qk.view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), *rope)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        attn = paged_attention_batched(q, kv[0], kv[1], meta, self.scale, cfg.sliding_window)
        o = self.o_proj(attn.reshape(t, cfg.q_size), mapping)
        x = x + (self.tp.all_reduce(o) if self.tp is not None else o)
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h, mapping).chunk(2, dim=-1)
        d = self.down_proj(F.silu(gate) * up, mapping)
        return x + (self.tp.all_reduce(d) if self.tp is not None else d)


class LlamaForCausalLM(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        lora_kw = {
            "max_loras": max_loras,
            "max_rank": max_lora_rank,
            "dtype": dtype,
            "device": device,
        }
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = torch.nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), False
        )
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, lora_kw, dtype, device) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = torch.nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), False
            )
        # model-level LoRA slots (model/lora/vocab.py): the embedding's and the LM head's
        self.embed_lora: VocabLoRA | None = None
        self.lm_head_lora: VocabLoRA | None = None
        if max_loras > 0:
            v, h = cfg.vocab_size, cfg.hidden_size
            self.embed_lora = VocabLoRA("embed_tokens", v, h, **lora_kw)
            self.lm_head_lora = VocabLoRA("lm_head", h, v, **lora_kw)
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, device
        )
        # a shard of a tensor-parallel model: ``cfg`` is the shard's (tp.shard_config), the
        # embedding and LM head hold its vocabulary rows
        self.tp: TensorParallel | None = None
        # full-table slots (modules_to_save, model/lora/full.py: attach_full_modules); None: none
        self.full_modules: FullModules | None = None

    def set_tensor_parallel(self, tp: TensorParallel) -> None:
        """Make this model (built from ``tp.shard_config``) run as its rank of ``tp``."""
        self.tp = tp
        for layer in self.layers:
            layer.tp = tp

    @property
    def max_loras(self) -> int:
        return self.layers[0].qkv_proj.max_loras

    @property
    def max_lora_rank(self) -> int:
        return self.layers[0].qkv_proj.max_rank

    def lora_linears(self) -> Iterator[tuple[int, dict[str, LoRALinear]]]:
        for i, layer in enumerate(self.layers):
            yield i, layer.lora_linears()

    def lora_vocab(self) -> dict[str, VocabLoRA]:
        """The model-level LoRA slots by module (``embed_tokens``, ``lm_head``); empty without
        LoRA slots."""
        mods = (self.embed_lora, self.lm_head_lora)
        return {m.name: m for m in mods if m is not None}

    @torch.no_grad()
    def set_base_layout(self, transposed: bool) -> None:
        """CPU path (the model runner's choice): base projections, the LM head and the tied
        embedding stored transposed, so that GEMMs of a few rows run on row-major (in, out)
        matrices (about 2x faster on CPU BLAS than F.linear on (out, in) at 2-16 rows).

        Values and shapes stay; ``embed_tokens`` / ``lm_head`` become transposed-strided views
        of (hidden, vocab) storage. Reversible; the fused GPU path needs ``transposed=False``.
        """
        for layer in self.layers:
            for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                lin.set_base_layout(transposed)
        tied = self.lm_head is self.embed_tokens
        for name in ("embed_tokens",) if tied else ("lm_head",):  # an untied table: row reads
            w = getattr(self, name)
            if w.is_contiguous() == (not transposed):
                continue
            relaid = w.t().contiguous().t() if transposed else w.contiguous()
            setattr(self, name, torch.nn.Parameter(relaid, False))
        if tied:
            self.lm_head = self.embed_tokens

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        mapping: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, hidden)."""
        fm = self.full_modules
        # ids of tokens an adapter added (full tables past the vocabulary, model/lora/full.py) reach
        # the base embedding clamped: their rows come from the adapter's table below
        ids = fm.base_ids(input_ids) if fm is not None and fm.extra else input_ids
        if self.tp is not None:
            x = self.tp.embed(ids, self.embed_tokens)
        else:
            x = F.embedding(ids, self.embed_tokens)
        # NOTE: a tensor-parallel shard takes no vocab LoRA (tp.shard_adapter refuses it)
        emb = self.embed_lora if self.tp is None else None
        if mapping is not None and mapping.has_lora and emb is not None:
            emb.add(x, ids, mapping.token_slots, triton=mapping.triton)
        if mapping is not None and mapping.has_lora and self.full_modules is not None:
            self.full_modules.embed_rows(x, input_ids, mapping.token_slots)
        rope = self.rope.table(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv, meta, mapping, rope)
        return self.norm(x)

    def compute_logits(
        self, hidden: torch.Tensor, mapping: LoRAMapping | None = None
    ) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 (a tensor-parallel shard gathers every rank's).
        ``mapping``: the slots of these N rows (their LM head LoRA deltas), or None (base)."""
        logits = F.linear(hidden, self.lm_head).float()
        fm = self.full_modules
        if fm is not None and fm.extra:  # logits V + E wide (model/lora/full.py: widen_logits)
            slots = None if mapping is None else mapping.token_slots
            if mapping is not None and self.lm_head_lora is not None:
                self.lm_head_lora.add(logits, hidden, mapping.token_slots, triton=mapping.triton)
            triton = mapping is not None and mapping.triton
            return fm.widen_logits(logits, hidden, slots, triton=triton)
        if mapping is not None and self.full_modules is not None:  # (never on a TP shard)
            self.full_modules.head_logits(
                logits, hidden, mapping.token_slots, triton=mapping.triton
            )
        if mapping is not None and self.lm_head_lora is not None and self.tp is None:
            self.lm_head_lora.add(logits, hidden, mapping.token_slots, triton=mapping.triton)
        return self.tp.gather_logits(logits) if self.tp is not None else logits


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF module -> (our fused module attribute, slice name)
_FUSED = {
    "self_attn.q_proj": ("qkv_proj", "q_proj"),
    "self_attn.k_proj": ("qkv_proj", "k_proj"),
    "self_attn.v_proj": ("qkv_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj", "o_proj"),
    "mlp.gate_proj": ("gate_up_proj", "gate_proj"),
    "mlp.up_proj": ("gate_up_proj", "up_proj"),
    "mlp.down_proj": ("down_proj", "down_proj"),
}


class LlamaWeights:
    """HF Llama checkpoint keys -> ``LlamaForCausalLM`` tensors (``registry.WeightMap``)."""

    def target(self, model: LlamaForCausalLM, name: str) -> torch.Tensor | None:
        """The tensor (or slice of a fused tensor) that checkpoint key ``name`` loads into."""
        if name == "model.embed_tokens.weight":
            return model.embed_tokens
        if name == "model.norm.weight":
            return model.norm.weight
        if name == "lm_head.weight":
            return None if model.cfg.tie_word_embeddings else model.lm_head
        m = _LAYER.match(name)
        if m is None:
            return None
        idx, rest = int(m.group(1)), m.group(2)
        if idx >= len(model.layers):
            raise ModelLoadError(f"checkpoint has layer {idx}, config has {len(model.layers)}")
        layer = model.layers[idx]
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            return getattr(layer, rest.split(".")[0]).weight
        module, _, kind = rest.rpartition(".")
        if module not in _FUSED or kind not in ("weight", "bias"):
            return None
        attr, slice_name = _FUSED[module]
        fused = getattr(layer, attr)
        s = fused.slice_index(slice_name)
        lo, hi = fused.slice_offsets[s], fused.slice_offsets[s + 1]
        param = fused.weight if kind == "weight" else fused.bias
        if param is None:
            raise ModelLoadError(f"{name}: the config declares no bias for this module")
        return param[lo:hi]

    def units(self, model: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]]:
        """Every weight the checkpoint must fill."""
        units = [("model.embed_tokens", model.embed_tokens), ("model.norm", model.norm.weight)]
        if not model.cfg.tie_word_embeddings:
            units.append(("lm_head", model.lm_head))
        for i, layer in enumerate(model.layers):
            for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                lin = getattr(layer, attr)
                units.append((f"layers.{i}.{attr}.weight", lin.weight))
                if lin.bias is not None:
                    units.append((f"layers.{i}.{attr}.bias", lin.bias))
            units.append((f"layers.{i}.input_layernorm", layer.input_layernorm.weight))
            units.append(
                (f"layers.{i}.post_attention_layernorm", layer.post_attention_layernorm.weight)
            )
        return units


FAMILY = ModelFamily(LlamaForCausalLM, LlamaWeights())
