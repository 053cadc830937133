"""A request's state while it moves through the engine, and the outputs it streams."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loraplex.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from loraplex.engine.detokenizer import IncrementalDetokenizer
    from loraplex.engine.lora.manager import AdapterVersion

__all__ = ["RequestStatus", "RequestOutput", "Request", "TokenLogprob"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class RequestOutput:
    """One streamed chunk: the NEW tokens and text since the previous chunk."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0
    stop_reason: str | int | None = None  # the stop string / token id that ended it
    error: BaseException | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterVersion | None = None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int = 0  # prefix-cache hit tokens at the last admission
    status: RequestStatus = RequestStatus.WAITING
    holds_slot: bool = False  # holds a GPU-slot reference on its adapter
    aborted: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    num_preemptions: int = 0
    scheduled_time: float | None = None  # first admission to the running queue
    token_times: list[float] = field(default_factory=list)  # monotonic time of each token
    eos_ids: frozenset[int] = frozenset()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def adapter_key(self) -> tuple[str, str] | None:
        return None if self.adapter is None else self.adapter.key

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
