"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from loraplex.engine.structured.spec import StructuredOutput

__all__ = ["SamplingParams", "InvalidSamplingParams", "MAX_LOGPROBS", "GREEDY_EPS"]

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy decoding.
GREEDY_EPS = 1e-5
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range or of the wrong type. ``field`` names it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to sample one request's tokens (OpenAI / vLLM semantics).

    ``temperature`` 0 means greedy; ``top_k`` -1 or 0 means off (normalised to -1); ``stop`` is
    normalised to a list of strings and ``stop_token_ids`` to a list of ints. ``logprobs`` is the
    number of top logprobs returned per generated token (0: only the sampled token's).
    ``structured`` constrains the output (JSON schema, regex, choice, grammar); logprobs stay
    those of the unconstrained distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    structured: StructuredOutput | None = None  # constrained decoding (engine/structured/)
    # speculative decoding may propose tokens for this request when the engine has it on
    # (EngineConfig.speculative_method); False: this request opts out (its output is the same
    # either way, only its speed differs)
    speculative: bool = True

    def __post_init__(self) -> None:
        self._check_ints()
        self._check_floats()
        self._normalise_stops()
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParams(
                f"ignore_eos must be a bool, got {self.ignore_eos!r}", field="ignore_eos"
            )
        if not isinstance(self.speculative, bool):
            raise InvalidSamplingParams(
                f"speculative must be a bool, got {self.speculative!r}", field="speculative"
            )
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidSamplingParams(
                f"structured must be a StructuredOutput, got {self.structured!r}",
                field="structured",
            )

    def _check_ints(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidSamplingParams(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", field="max_tokens"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidSamplingParams(
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", field="min_tokens"
            )
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                field="min_tokens",
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidSamplingParams(
                f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}",
                field="top_k",
            )
        if self.top_k == 0:
            self.top_k = -1
        if self.seed is not None and (
            not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            raise InvalidSamplingParams(
                f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}", field="seed"
            )
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidSamplingParams(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                field="logprobs",
            )

    def _check_floats(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise InvalidSamplingParams(
                f"temperature must be a finite number >= 0, got {t!r}", field="temperature"
            )
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {p!r}", field="top_p")
        self.temperature, self.top_p = float(t), float(p)

    def _normalise_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidSamplingParams(
                f"stop must be a string or a list of strings, got {self.stop!r}", field="stop"
            )
        if any(s == "" for s in stop):
            raise InvalidSamplingParams("stop strings must not be empty", field="stop")
        self.stop = list(dict.fromkeys(stop))
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise InvalidSamplingParams(
                f"stop_token_ids must be a list of non-negative integers, got {ids!r}",
                field="stop_token_ids",
            )
        self.stop_token_ids = list(ids)

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (always a list after validation)."""
        return list(self.stop or [])

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)
