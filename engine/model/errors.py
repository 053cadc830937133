"""Typed errors of reading a base model's config: below config.py and the registry."""

from __future__ import annotations

__all__ = ["ModelConfigError", "UnknownArchitectureError"]


class ModelConfigError(ValueError):
    """config.json is missing, malformed or describes an unsupported architecture."""


class UnknownArchitectureError(ModelConfigError):
    """config.json names an architecture (and model_type) no registered family serves."""
