"""Typed engine errors (adapter errors live in loraplex.engine.lora.errors)."""

from __future__ import annotations

__all__ = [
    "EngineError",
    "InvalidRequestError",
    "AdapterCompositionError",
    "EngineClosedError",
    "RequestAbortedError",
    "TensorParallelWorkerError",
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
