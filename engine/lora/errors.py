"""Typed errors for adapters. Every message names the offending field or file."""

from __future__ import annotations

__all__ = [
    "LoRAError",
    "AdapterNotFoundError",
    "AdapterConfigError",
    "AdapterFormatError",
    "AdapterValueError",
    "AdapterShapeError",
    "AdapterRankError",
    "AdapterTargetError",
    "AdapterDigestError",
    "AdapterSourceError",
    "AdapterPolicyError",
    "AdapterTooLargeError",
    "SlotFullError",
]


class LoRAError(Exception):
    """Base class of every adapter error. ``field`` names the offending item, if any."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class AdapterNotFoundError(LoRAError):
    """No adapter of that name is known, or its source holds no adapter."""


class AdapterConfigError(LoRAError):
    """adapter_config.json is missing, malformed or asks for an unsupported feature."""


class AdapterFormatError(LoRAError):
    """The weight file is missing, not safetensors, or structurally invalid."""


class AdapterValueError(AdapterFormatError):
    """A weight tensor holds NaN, Inf or values far beyond any trained adapter's."""


class AdapterShapeError(LoRAError):
    """A tensor's shape or dtype does not fit the base model."""


class AdapterRankError(LoRAError):
    """The adapter's rank is above the engine's ``max_lora_rank``."""


class AdapterTargetError(LoRAError):
    """The adapter targets modules or layers the base model does not have."""


class AdapterDigestError(LoRAError):
    """The adapter's content does not match the configured sha256 digest."""


class AdapterSourceError(LoRAError):
    """The adapter's source cannot be used: unknown URI scheme, bad URI, or the fetch failed."""


class AdapterPolicyError(AdapterSourceError):
    """The source URI is outside the operator's allowlist or local roots."""


class AdapterTooLargeError(LoRAError):
    """The adapter's files are larger than the configured byte quota."""


class SlotFullError(LoRAError):
    """Every GPU slot is pinned: a request that needs a new slot cannot be served."""
