"""Qwen3-MoE and Mixtral decoders with LoRA slots on attention: reference forward (the CPU path
and the oracle of the GPU forward, ``moe/forward.py``).

A layer is Llama's attention (fused qkv, o; ``LoRALinear``), with Qwen3's per-head q / k
RMSNorm before RoPE where the config says so (``ModelConfig.qk_norm``), and either a sparse
MLP (``block.SparseMoe``: router + experts) or, on Qwen3-MoE's ``mlp_only_layers`` / off-step
layers, Llama's dense MLP (fused gate_up, down). Everything outside the decoder layers
(embedding, final norm, LM head, vocab LoRA, full tables, the step's rotary table) is
``LlamaForCausalLM``'s: ``MoeForCausalLM`` is that model with these layers.

LoRA: adapters on q / k / v / o serve as on dense models (and on the MLP modules of dense
layers); the experts take theirs in the sparse block's slots (``expert_lora.py``); the router
takes none.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from loraplex.engine.model.attention import AttentionMetadata, paged_attention_batched, write_kv
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.errors import ModelConfigError
from loraplex.engine.model.llama import LlamaForCausalLM, RMSNorm
from loraplex.engine.model.lora.layers import LoRALinear
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.moe.block import SparseMoe
from loraplex.engine.model.moe.expert_lora import ExpertLoRA
from loraplex.engine.model.rope import apply_rotary
from loraplex.engine.model.tp import TensorParallel, TensorParallelError

__all__ = ["MoeDecoderLayer", "MoeForCausalLM"]


class MoeDecoderLayer(torch.nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        lora_kw: dict,
        dtype: torch.dtype,
        device,
        max_expert_loras: int | None = None,
    ) -> None:
        super().__init__()
        assert cfg.moe is not None
        h = cfg.hidden_size
        self.cfg = cfg
        self.index = index
        self.qkv_proj = LoRALinear(
            h,
            {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size},
            bias=cfg.qkv_bias,
            **lora_kw,
        )
        self.o_proj = LoRALinear(cfg.q_size, {"o_proj": h}, bias=cfg.o_bias, **lora_kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        # the MLP: the experts, or (a dense layer of Qwen3-MoE) Llama's fused projections
        self.mlp: SparseMoe | None = None
        self.gate_up_proj: LoRALinear | None = None
        self.down_proj: LoRALinear | None = None
        if cfg.moe.is_sparse(index):
            self.mlp = SparseMoe(
                h, cfg.moe, dtype, device, max_loras=lora_kw["max_loras"],
                max_rank=lora_kw["max_rank"], max_expert_loras=max_expert_loras,
            )  # fmt: skip
        else:
            i = cfg.intermediate_size
            self.gate_up_proj = LoRALinear(
                h, {"gate_proj": i, "up_proj": i}, bias=cfg.mlp_bias, **lora_kw
            )
            self.down_proj = LoRALinear(i, {"down_proj": h}, bias=cfg.mlp_bias, **lora_kw)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.scale = cfg.head_dim**-0.5

    def projections(self) -> list[LoRALinear]:
        """The layer's LoRA-capable projections (the experts are not)."""
        mods = [self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj]
        return [m for m in mods if m is not None]

    def lora_linears(self) -> dict[str, LoRALinear]:
        """Original module name -> the fused layer holding its slice."""
        return {name: lin for lin in self.projections() for name in lin.slice_names}

    def forward(
        self,
        x: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        mapping: LoRAMapping | None,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """As ``llama.DecoderLayer.forward``, HF's op order (q / k norm on the projection's
        output, LoRA delta included, before RoPE)."""
        cfg = self.cfg
        t = x.shape[0]
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h, mapping)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        qk = apply_rotary(torch.cat([q, k], dim=1), *rope)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        attn = paged_attention_batched(q, kv[0], kv[1], meta, self.scale, cfg.sliding_window)
        x = x + self.o_proj(attn.reshape(t, cfg.q_size), mapping)
        h = self.post_attention_layernorm(x)
        if self.mlp is not None:  # the Triton kernel on CUDA, its twin elsewhere
            slots = mapping.token_slots if mapping is not None else None
            return x + self.mlp(h, triton=h.is_cuda, token_slots=slots)
        assert self.gate_up_proj is not None and self.down_proj is not None
        gate, up = self.gate_up_proj(h, mapping).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up, mapping)


class MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with ``MoeDecoderLayer`` layers: built as a Llama model of no layers
    (embedding, norm, LM head, vocab LoRA, rotary), then given the MoE layers; its forward,
    logits and LoRA accessors walk ``self.layers`` and serve unchanged."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_expert_loras: int | None = None,
    ) -> None:
        """``max_expert_loras``: LoRA slots 0 .. N-1 hold expert LoRA storage (None: all)."""
        if cfg.moe is None:
            raise ModelConfigError(f"model_type {cfg.model_type!r} has no mixture of experts")
        if cfg.num_layers < 1:
            raise ModelConfigError("config.json: num_hidden_layers must be >= 1")
        shell = dataclasses.replace(cfg, num_layers=0)
        super().__init__(
            shell, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device
        )
        self.cfg = cfg
        lora_kw = {"max_loras": max_loras, "max_rank": max_lora_rank, "dtype": dtype}
        lora_kw["device"] = device
        self.layers = torch.nn.ModuleList(
            MoeDecoderLayer(cfg, i, lora_kw, dtype, device, max_expert_loras)
            for i in range(cfg.num_layers)
        )
        self.max_expert_loras = max_loras if max_expert_loras is None else max_expert_loras

    def set_tensor_parallel(self, tp: TensorParallel) -> None:
        raise TensorParallelError(
            "mixture-of-experts models are not split over ranks yet: serve "
            f"{self.cfg.architecture} with tensor_parallel_size 1"
        )

    def fused_forward(self, *args, **kw) -> torch.Tensor:
        """The GPU forward (``moe/forward.py``): ``fused.fused_forward`` hands a model that has
        this method its arguments."""
        from loraplex.engine.model.moe.forward import moe_fused_forward

        return moe_fused_forward(self, *args, **kw)

    def expert_loras(self) -> list[tuple[int, ExpertLoRA]]:
        """(layer index, its expert LoRA slots) of every sparse layer (none without slots)."""
        out = []
        for i, layer in enumerate(self.layers):
            if layer.mlp is not None and layer.mlp.lora is not None:
                out.append((i, layer.mlp.lora))
        return out

    def sparse_blocks(self) -> list[SparseMoe]:
        """The sparse MLPs, in layer order."""
        return [layer.mlp for layer in self.layers if layer.mlp is not None]

    @torch.no_grad()
    def set_base_layout(self, transposed: bool) -> None:
        """The layers' projections as in ``LlamaForCausalLM.set_base_layout``; the experts keep
        (E, out, in) (the grouped GEMM and its twin read that layout); the embedding and the
        LM head are the Llama model's own business, which it does with no layers to walk."""
        for layer in self.layers:
            for lin in layer.projections():
                lin.set_base_layout(transposed)
        layers = self.layers
        self.layers = torch.nn.ModuleList()
        try:
            super().set_base_layout(transposed)
        finally:
            self.layers = layers
