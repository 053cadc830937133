"""Mixture-of-experts families (Qwen3-MoE, Mixtral): config fields (``spec``), routing, the
grouped expert GEMM (Triton + torch twin), the sparse MLP block, the model and its checkpoint
map, and the GPU forward. docs/architecture.md, "Mixture of experts", has the layout.

NOTE: imports nothing here: ``model/config.py`` imports ``moe.spec`` below the families.
"""
