"""Base-model configuration read from a HF ``config.json`` (Llama, Mistral, Qwen2, and the
mixture-of-experts Qwen3-MoE and Mixtral: ``moe``, ``moe/spec.py``).

Which families are served is the registry's business (``registry.py``): ``from_dict`` asks it
for the architecture first, so an unsupported model fails with ``UnknownArchitectureError``
before any field is read. A ``quantization_config`` other than the fp8 forms ``quant.py``
reads fails here too (``UnsupportedQuantizationError``), before any tensor is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.engine.model.errors import ModelConfigError
from loraplex.engine.model.moe.lora_names import expert_module, expert_module_order, per_expert_name
from loraplex.engine.model.moe.spec import QK_NORM_MODEL_TYPES, MoeSpec, parse_moe
from loraplex.engine.model.quant import Fp8Format, parse_quantization_config
from loraplex.engine.model.registry import architecture_for

__all__ = [
    "ModelConfig",
    "LORA_MODULES",
    "VOCAB_LORA_MODULES",
    "VOCAB_LAYER",
    "MODULE_ORDER",
    "MLP_MODULES",
    "ModelConfigError",
]

# NOTE: the order is the order of slices in the fused layers: qkv = (q, k, v), gate_up = (gate, up).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a dense MLP's projections: absent from the sparse (experts) layers of a MoE model
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Model-level LoRA targets (one each, outside the decoder layers): the input embedding and the
# LM head. Adapter weights key them as (VOCAB_LAYER, name); as LoRA "linears" they read
# (in, out) = (vocab, hidden) for the embedding (PEFT's lora_embedding_A is (r, vocab), the
# delta is onehot(ids) @ A^T @ B^T) and (hidden, vocab) for the head.
VOCAB_LORA_MODULES = ("embed_tokens", "lm_head")
VOCAB_LAYER = -1


class _ModuleOrder(dict):
    """The dense and vocab modules' order; an expert module's (moe/lora_names.py) on lookup."""

    def __missing__(self, module: str) -> int:
        return expert_module_order(module)


# (layer, module) keys sort as (layer, MODULE_ORDER[module]): slot images, packing, composition
MODULE_ORDER: dict[str, int] = _ModuleOrder(
    {m: i for i, m in enumerate(LORA_MODULES + VOCAB_LORA_MODULES)}
)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    o_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    architecture: str = "LlamaForCausalLM"  # the registered HF architecture (registry.py)
    quantization: Fp8Format | None = None  # a pre-quantized fp8 checkpoint (quant.py)
    # rows past vocab_size that an adapter's full tables may add (EngineConfig's
    # lora_extra_vocab_size, set on the adapter checks' copy); 0: the base's rows only
    lora_extra_vocab_size: int = 0
    # mixture of experts (moe/spec.py): its sparse layers have experts, not the MLP modules
    moe: MoeSpec | None = None
    qk_norm: bool = False  # q and k RMS-normalised per head before RoPE (Qwen3)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def lora_module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable module of one layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def vocab_lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the model-level LoRA targets (``VOCAB_LORA_MODULES``)."""
        v, h = self.vocab_size, self.hidden_size
        return {"embed_tokens": (v, h), "lm_head": (h, v)}

    def has_module(self, layer: int, module: str) -> bool:
        """Whether decoder layer ``layer`` has LoRA module ``module`` (a MoE model's sparse
        layers have no dense MLP projections, only they have expert modules)."""
        moe = self.moe
        em = expert_module(module)
        if em is not None:
            sparse = moe is not None and moe.is_sparse(layer)
            return sparse and (em.expert is None or em.expert < moe.num_experts)  # type: ignore[union-attr]
        return moe is None or module not in MLP_MODULES or not moe.is_sparse(layer)

    def expert_module_shape(self, module: str) -> tuple[int, int, int] | None:
        """(in, out, experts) of an expert LoRA module (moe/lora_names.py): ``experts`` E for
        the fused form (its A holds E rank-r blocks), 1 per expert; None for other names."""
        em = expert_module(module)
        if em is None or self.moe is None:
            return None
        d_in, d_out = em.shape(self.hidden_size, self.moe.expert_size)
        return d_in, d_out, self.moe.num_experts if em.fused else 1

    def expert_module_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, module) -> (in, out) of every per-expert LoRA module (the largest expert
        layout: per expert gate, up and down, each rank R, outweighs the fused form's)."""
        moe = self.moe
        if moe is None:
            return {}
        mixtral = self.model_type == "mixtral"
        out = {}
        for i in moe.sparse_layers:
            for e in range(moe.num_experts):
                for role in ("gate", "up", "down"):
                    name = per_expert_name(e, role, mixtral)
                    out[(i, name)] = self.expert_module_shape(name)[:2]  # type: ignore[index]
        return out

    def adapter_module_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, module) -> (in, out) of every LoRA target of the model, vocab ones included."""
        per_layer = self.lora_module_shapes()
        out = {
            (i, m): s
            for i in range(self.num_layers)
            for m, s in per_layer.items()
            if self.has_module(i, m)
        }
        out.update({(VOCAB_LAYER, m): s for m, s in self.vocab_lora_shapes().items()})
        return out

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> ModelConfig:
        mtype = cfg.get("model_type")
        names = cfg.get("architectures")
        names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
        arch = architecture_for(names, mtype)
        quantization = parse_quantization_config(cfg.get("quantization_config"))
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
            scaling = cfg.get("rope_scaling") or None
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = rope
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            if scaling is not None:
                scaling = dict(scaling)
                kind = scaling.get("rope_type", scaling.get("type", "default"))
                if kind == "default":
                    scaling = None
                elif kind not in ("llama3", "linear"):
                    raise ModelConfigError(f"rope_scaling type {kind!r} is not supported")
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            layers = int(cfg["num_hidden_layers"])
            return ModelConfig(
                model_type=mtype,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=mtype == "qwen2" or bool(cfg.get("attention_bias", False)),
                o_bias=mtype != "qwen2" and bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                rope_scaling=scaling,
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                architecture=arch,
                quantization=quantization,
                moe=parse_moe(cfg, mtype, layers),
                qk_norm=mtype in QK_NORM_MODEL_TYPES,
                raw=cfg,
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json lacks required field {e.args[0]!r}") from None

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"no config.json in {path}") from None
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"config.json is not valid JSON: {e}") from None
        return ModelConfig.from_dict(cfg)
