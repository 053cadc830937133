"""Schedulers on fake KV blocks and registries, and the steps the scheduler tests run on them.

``make``: a scheduler over ``FakeBlocks`` and a registry with a fake loader; ``submit``, ``rows``,
``run_step``, ``check_references``; ``make_scheduler`` / ``running``: a scheduler on real KV
blocks for the pipelined-step tests."""

from __future__ import annotations

import time

from loraplex.engine.adapters.registry import AdapterRegistry, AdapterVersion
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.config import EngineConfig
from loraplex.engine.kv import BlockManager
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from tests.helpers.adapters import FakeLoader
from tests.helpers.engine import config
from tests.helpers.slots import FakeWriter

BLOCK = 4  # tokens per KV block


class FakeBlocks:
    """The block-manager calls the scheduler makes, on a count of blocks per request (no
    prefix cache: ``cached`` says how many prompt tokens ``allocate`` reports as cached)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tables: dict[str, int] = {}  # request id -> blocks it holds
        self.keys: dict[str, object] = {}  # request id -> adapter key it allocated under
        self.cached: dict[str, int] = {}
        self.computed: dict[str, int] = {}  # request id -> num_computed of mark_computed

    def __contains__(self, rid: object) -> bool:
        return rid in self.tables

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - sum(self.tables.values())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // BLOCK)

    def block_table(self, rid: str) -> list[int]:
        return list(range(self.tables[rid]))

    def can_allocate(self, rid: str, tokens, key) -> bool:
        assert rid not in self.tables, f"{rid} already holds blocks"
        return self.blocks_needed(len(tokens)) <= self.num_free_blocks

    def allocate(self, rid: str, tokens, key) -> int:
        assert self.can_allocate(rid, tokens, key)
        self.tables[rid] = self.blocks_needed(len(tokens))
        self.keys[rid] = key
        return self.cached.get(rid, 0)

    def append(self, rid: str, num_tokens: int) -> None:
        extra = self.blocks_needed(num_tokens) - self.tables[rid]
        assert extra <= self.num_free_blocks, f"{rid} grows past the free blocks"
        self.tables[rid] += max(extra, 0)

    def free(self, rid: str) -> None:
        del self.tables[rid]

    def mark_computed(self, rid: str, tokens, num_computed: int) -> None:
        self.computed[rid] = num_computed


def make(
    num_blocks: int = 64,
    *,
    max_loras: int = 2,
    max_cpu_loras: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    slot_write_join_bytes: int = 128 << 20,
) -> tuple[Scheduler, FakeBlocks, AdapterRegistry, FakeLoader]:
    cfg = EngineConfig(
        slot_write_join_bytes=slot_write_join_bytes,
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK,
        starvation_timeout_s=10.0,
    )
    loader = FakeLoader()
    slots = SlotStore(max_loras, writer=FakeWriter())
    adapters = AdapterRegistry(
        max_loras=max_loras, max_cpu_loras=max_cpu_loras, loader=loader, slots=slots
    )
    blocks = FakeBlocks(num_blocks)
    return Scheduler(cfg, blocks, adapters), blocks, adapters, loader


def submit(
    s: Scheduler,
    rid: str,
    n_prompt: int = 3,
    v: AdapterVersion | None = None,
    *,
    max_tokens: int = 16,
    starved: bool = False,
    group: str = "",
) -> Request:
    """What AsyncEngine.generate does: count the adapter user, queue the request."""
    params = SamplingParams(max_tokens=max_tokens)
    r = Request(rid, list(range(1, n_prompt + 1)), params, v, group=group)
    if starved:
        r.arrival = time.monotonic() - 60.0
    if v is not None:
        s.adapters.add_user(v)
    s.add(r)
    return r


def rows(plan: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(c.req.request_id, c.num_tokens, c.need_logits) for c in plan.chunks]


def run_step(s: Scheduler, plan: SchedulerOutput, token: int = 7) -> None:
    """What the step and postprocess do to the scheduler: KV written, one token sampled
    for each chunk that asks for one."""
    for c in plan.chunks:
        s.mark_computed(c)
        if c.need_logits:
            c.req.output_ids.append(token)


def check_references(s: Scheduler, blocks: FakeBlocks) -> None:
    """Running requests hold blocks and (with an adapter) one slot reference each; waiting
    ones hold neither."""
    assert set(blocks.tables) == {r.request_id for r in s.running}
    refs: dict[int, int] = {}
    for r in s.running:
        assert r.status is RequestStatus.RUNNING
        assert r.holds_slot is (r.adapter is not None)
        if r.adapter is not None:
            refs[id(r.adapter)] = refs.get(id(r.adapter), 0) + 1
    for r in s.waiting:
        assert r.status is RequestStatus.WAITING and not r.holds_slot
    for v in s.adapters.versions():
        assert s.slots.refs(v) == refs.get(id(v), 0), v.name


def make_scheduler(**kw) -> tuple[Scheduler, BlockManager]:
    cfg = config("unused", max_num_seqs=kw.pop("max_num_seqs", 8), **kw)
    blocks = BlockManager(kw.get("num_kv_blocks", 8), cfg.block_size, True)
    adapters = AdapterRegistry(max_loras=2, max_cpu_loras=2, loader=None, on_change=lambda: None)
    return Scheduler(cfg, blocks, adapters), blocks


def running(s: Scheduler, rid: str, prompt: list[int], max_tokens: int = 10) -> Request:
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens))
    s.add(r)
    return r
