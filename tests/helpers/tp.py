"""Tensor-parallelism test helpers: ``CFG``, the small model config the sharding tests split."""

from __future__ import annotations

from loraplex.engine.model.config import ModelConfig

CFG = ModelConfig(
    model_type="llama", vocab_size=250, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
    max_position_embeddings=64,
)  # fmt: skip
