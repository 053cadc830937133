"""A request's state while it moves through the engine, and the outputs it streams."""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from loraplex.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from loraplex.engine.adapters.version import AdapterVersion
    from loraplex.engine.detokenizer import IncrementalDetokenizer
    from loraplex.engine.structured.grammars import Guide

__all__ = ["RequestStatus", "RequestOutput", "Request", "TokenLogprob", "Tokens"]


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


class Tokens(Sequence[int]):
    """Prompt then output tokens, read in place: building the whole list for every row of
    every step costs O(context) per row (at 3 000-token contexts it was the largest item of the
    loop's step work). Slices are lists."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt = prompt
        self._output = output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        p = self._prompt
        n = len(p)
        if isinstance(i, slice):
            lo, hi, step = i.indices(n + len(self._output))
            if step != 1:
                return list(self)[i]
            if hi <= n:
                return p[lo:hi]
            if lo >= n:
                return self._output[lo - n : hi - n]
            return p[lo:] + self._output[: hi - n]
        if i < 0:
            i += len(self)
            if i < 0:
                raise IndexError("token index out of range")
        if i < n:
            return p[i]
        return self._output[i - n]  # IndexError past the end, as a list

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._prompt, self._output)

    def parts(self) -> tuple[list[int], list[int]]:
        """The prompt and output lists themselves (read only)."""
        return self._prompt, self._output

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Tokens, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Tokens({list(self)!r})"


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
    # the GPU slot it reads while running (a reference on its adapter's slot, taken by the
    # scheduler from the slot store); -1: none
    slot: int = -1
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
    guide: Guide | None = None  # the matcher of a structured-output request
    # the requests of one API request (its n choices, its prompts) share a group: they share
    # max_num_seqs fairly with other groups (fair_share.py); "": a group of its own
    group: str = ""

    @property
    def holds_slot(self) -> bool:
        """It holds a reference on its adapter's GPU slot (it is running on it)."""
        return self.slot >= 0

    def __post_init__(self) -> None:
        if not self.group:
            self.group = self.request_id

    @property
    def tokens(self) -> Tokens:
        """Prompt + output tokens, without copying (see ``Tokens``)."""
        return Tokens(self.prompt_ids, self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def adapter_key(self) -> tuple[str, str] | None:
        return None if self.adapter is None else self.adapter.key

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
