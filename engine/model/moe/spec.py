"""What a mixture-of-experts config.json says about its sparse MLPs (``MoeSpec``).

Read by ``ModelConfig.from_dict`` for the MoE families (``moe/model.py``), before any tensor:

| field          | Qwen3-MoE (``qwen3_moe``)                         | Mixtral (``mixtral``)        |
|----------------|---------------------------------------------------|------------------------------|
| experts        | ``num_experts`` (saved as ``num_local_experts``)  | ``num_local_experts``        |
| top k          | ``num_experts_per_tok``                           | ``num_experts_per_tok``      |
| expert width   | ``moe_intermediate_size``                         | ``intermediate_size``        |
| renormalize    | ``norm_topk_prob``                                | always                       |
| routing weights| cast to the model dtype                           | kept in float32              |
| sparse layers  | not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0 | every layer |

A Qwen3-MoE layer that is not sparse is a dense MLP of ``intermediate_size`` (as in HF). Neither
family has shared experts (Qwen2-MoE's ``shared_expert`` is another architecture).

NOTE: below config.py (it imports this module): imports only the model's errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraplex.engine.model.errors import ModelConfigError

__all__ = ["MoeSpec", "MOE_MODEL_TYPES", "QK_NORM_MODEL_TYPES", "parse_moe"]

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
# families whose attention normalises q and k per head (RMSNorm over head_dim) before RoPE
QK_NORM_MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int  # E
    top_k: int  # experts per token
    expert_size: int  # I: each expert's gate / up width (down's input)
    renormalize: bool  # top-k probabilities divided by their sum
    fp32_weights: bool  # routing weights stay float32 (Mixtral); else cast to the model dtype
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is the experts (sorted)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def _int(cfg: dict[str, Any], *names: str, default: int | None = None) -> int:
    for name in names:
        value = cfg.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelConfigError(f"config.json: {name} must be an integer, got {value!r}")
            return value
    if default is None:
        raise ModelConfigError(f"config.json lacks required field {names[0]!r}")
    return default


def parse_moe(cfg: dict[str, Any], model_type: str | None, num_layers: int) -> MoeSpec | None:
    """The MoE fields of a config.json of ``model_type`` (None for dense families)."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"config.json: hidden_act {act!r} is not served (only silu)")
    if model_type == "mixtral":
        experts = _int(cfg, "num_local_experts", default=8)
        top_k = _int(cfg, "num_experts_per_tok", default=2)
        width = _int(cfg, "intermediate_size")
        renorm, fp32, sparse = True, True, tuple(range(num_layers))
    else:
        experts = _int(cfg, "num_experts", "num_local_experts", default=128)
        top_k = _int(cfg, "num_experts_per_tok", default=8)
        width = _int(cfg, "moe_intermediate_size", default=768)
        renorm, fp32 = bool(cfg.get("norm_topk_prob", False)), False
        step = _int(cfg, "decoder_sparse_step", default=1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise ModelConfigError(f"config.json: mlp_only_layers must be a list of ints: {only!r}")
        if step < 1:
            raise ModelConfigError(f"config.json: decoder_sparse_step {step} must be >= 1")
        sparse = tuple(
            i for i in range(num_layers) if i not in only and experts > 0 and (i + 1) % step == 0
        )
    if sparse and experts < 1:
        raise ModelConfigError(f"config.json: {experts} experts")
    if sparse and not 1 <= top_k <= experts:
        raise ModelConfigError(
            f"config.json: num_experts_per_tok {top_k} must be in 1..{experts} (the expert count)"
        )
    if width < 1:
        raise ModelConfigError(f"config.json: expert width {width} must be >= 1")
    return MoeSpec(experts, top_k, width, renorm, fp32, sparse)
