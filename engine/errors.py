"""Typed errors of the engine and of its adapters.

``EngineError`` and its subclasses are the engine's (requests, compositions, the engine's
state, tensor-parallel workers); ``LoRAError`` and its subclasses are every adapter error
(names, sources and policy, files, shapes, values, GPU slots, loader processes). Every message
names the offending field or file (``field``). The server maps both families to HTTP statuses
(server/errors.py); resolvers import the adapter errors they raise from ``loraplex.resolvers``.
A leaf module: it imports nothing of the engine.
"""

from __future__ import annotations

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "AdapterCompositionError",
    "EngineClosedError",
    "RequestAbortedError",
    "TensorParallelWorkerError",
    "SpeculativeConfigError",
    "LoRAError",
    "AdapterNotFoundError",
    "AdapterConfigError",
    "AdapterFormatError",
    "AdapterValueError",
    "AdapterShapeError",
    "AdapterRankError",
    "AdapterTargetError",
    "AdapterDigestError",
    "StagedCopyChangedError",
    "AdapterSourceError",
    "AdapterPolicyError",
    "AdapterTooLargeError",
    "SlotFullError",
    "LoaderProcessError",
    "SlotWriteError",
]


class EngineError(Exception):
    """Base class of engine errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is malformed (empty prompt, too long, unknown token ids...)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class AdapterCompositionError(InvalidRequestError):
    """A per-request composition of adapters cannot be served: unknown or repeated names,
    bad weights, or a summed rank above ``max_lora_rank``."""


class EngineClosedError(EngineError):
    """The engine is not running (not started, or closed)."""


class RequestAbortedError(EngineError):
    """The request was aborted before it produced its first output."""


class TensorParallelWorkerError(EngineError, RuntimeError):
    """A tensor-parallel worker process failed to start, died or left its group: the engine
    cannot run steps any more (every request in flight and every later step fails with it)."""


class SpeculativeConfigError(EngineError, ValueError):
    """Speculative decoding was asked for in a combination the engine does not serve (tensor
    parallelism, an fp8 base, a draft model not given or not built, K out of range); raised
    at start-up. ``field`` names the EngineConfig field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# -- adapter errors -------------------------------------------------------------------------------


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


class StagedCopyChangedError(AdapterDigestError):
    """The engine's sealed staging copy of a verified adapter changed on disk since it was
    sealed (adapters/seal.py): it is not used; the engine fetches and verifies the source
    again."""


class AdapterSourceError(LoRAError):
    """The adapter's source cannot be used: unknown URI scheme, bad URI, or the fetch failed."""


class AdapterPolicyError(AdapterSourceError):
    """The source URI is outside the operator's allowlist or local roots."""


class AdapterTooLargeError(LoRAError):
    """The adapter's files are larger than the configured byte quota."""


class SlotFullError(LoRAError):
    """Every GPU slot is pinned: a request that needs a new slot cannot be served."""


class LoaderProcessError(LoRAError):
    """A loader process died (twice) while it handled this adapter's load, or broke."""


class SlotWriteError(LoRAError):
    """An adapter's GPU slot write failed on the device (the engine logged why): the requests
    waiting on that adapter fail with it; a later request writes the slot again."""
