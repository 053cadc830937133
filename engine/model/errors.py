"""Typed errors of reading a base model's config: below config.py and the registry."""

from __future__ import annotations

__all__ = ["ModelConfigError", "UnknownArchitectureError", "UnsupportedQuantizationError"]


class ModelConfigError(ValueError):
    """config.json is missing, malformed or describes an unsupported architecture."""


class UnknownArchitectureError(ModelConfigError):
    """config.json names an architecture (and model_type) no registered family serves."""


class UnsupportedQuantizationError(ModelConfigError):
    """config.json's ``quantization_config`` names a format the engine does not serve (only
    fp8 e4m3 weights are: ``quant_method`` ``fp8``, or ``compressed-tensors`` with 8-bit float
    weights). Raised while reading the config, before any tensor is read."""
