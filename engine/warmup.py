"""Start-up warm-up of the eager step path, so that no kernel compiles while serving.

Decode steps replay CUDA graphs captured at start-up; a step that mixes prefill chunks with
decodes runs eagerly. Its Triton kernels are compiled per variant: the launch configs depend on
the step's token count T (``*_config(T)`` buckets) and the attention tile on the longest query
(``max_query_len`` buckets), and Triton specializes integer arguments (== 1, divisible by 16)
such as T and the block-table width. A variant first met while serving compiles for 0.7-1.0 s
at the 8B shape and freezes every running stream for as long.
``warm_eager_steps`` runs one eager forward per variant class before the engine serves.

``CompileWatch`` counts Triton compiles; after start-up each one is logged as a warning
(``kernel_compiled_while_serving``) and counted in ``stats()["kernel_compiles"]``.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from loraplex.engine.model_runner import ModelRunner, StepItem

__all__ = ["warm_eager_steps", "warm_slot_writes", "eager_shapes", "CompileWatch", "COMPILES"]

log = structlog.get_logger("loraplex.engine")


def _token_counts(max_tokens: int) -> list[int]:
    """T values covering every config bucket x integer-specialization class up to max_tokens."""
    out = {2, 3}
    for edge in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
        out |= {edge - 1, edge, edge + 1, edge + 16}
    out.add(max_tokens)
    return sorted(t for t in out if 2 <= t <= max_tokens)


def eager_shapes(
    max_tokens: int, max_seqs: int, block_size: int, max_len: int, num_blocks: int
) -> list[list[tuple[int, int, int]]]:
    """Steps to warm: each a list of (new tokens, start position, block-table width) items.

    1. one step per token count T (the epilogue kernels' variants): a prefill chunk of T - 1
       tokens next to one decode row;
    2. one step per (longest query, block-table width) class (the attention tile variants):
       query lengths at every power of two (the tile is a power of two over them), widths of
       1, 16 (divisible) and 17 blocks (neither).
    """
    steps: list[list[tuple[int, int, int]]] = []

    def width(pos: int, n: int) -> int:
        return -(-(pos + n) // block_size)

    for t in _token_counts(max_tokens):
        n = t - 1
        if n + 1 > max_len or width(0, n) > num_blocks:
            continue
        steps.append(
            [(n, 0, width(0, n)), (1, block_size - 1, 1)] if max_seqs > 1 else [(t, 0, width(0, t))]
        )
    qlens = [q for q in (2, 3, 5, 9, 17, 33, 65, 129, 257) if q <= min(max_tokens, max_len)]
    for q in qlens:
        for w in (1, 16, 17):
            if w * block_size > max_len or w > num_blocks or q > w * block_size:
                continue
            steps.append([(q, w * block_size - q, w)])
    return steps


@torch.inference_mode()
def warm_eager_steps(runner: ModelRunner, max_tokens: int, max_seqs: int, max_len: int) -> int:
    """Run the eager forward once per shape of ``eager_shapes`` (start-up only: it writes
    garbage into KV blocks no request owns yet). Returns the number of steps run."""
    bs = runner.block_size
    num_slots = len(runner.slot_ranks.ranks)
    shapes = eager_shapes(max_tokens, max_seqs, bs, max_len, runner.num_blocks)
    t0 = time.perf_counter()
    for k, step in enumerate(shapes):
        items = [
            StepItem(
                token_ids=[1] * n,
                start_pos=pos,
                block_table=list(range(w)),
                lora_slot=(k + i) % (num_slots + 1) - 1,  # base rows and slotted rows
                need_logits=True,
            )
            for i, (n, pos, w) in enumerate(step)
        ]
        runner.execute(items)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info("eager_steps_warmed", steps=len(shapes), seconds=round(time.perf_counter() - t0, 2))
    return len(shapes)


@torch.no_grad()
def warm_slot_writes(buffers: Any, pool: Any, stream: Any) -> None:
    """One full-size slot write on ``stream`` (the side stream of cold loads) out of a host-pool
    region, then the slot cleared (``buffers``: the runner's ``SlotBuffers``): allocates the
    write's device staging buffer, loads its kernels and makes the full layout's scatter plans
    now rather than on the first cold loads."""
    from loraplex.engine.model.lora.slot_image import PackedAdapter

    model = buffers.model
    region = pool.acquire()
    if region is None:
        return
    try:
        entries, numel = warm_layout(model)
        buf = pool.view(region, model.dtype, numel)
        buf.zero_()
        packed = PackedAdapter(buf, entries, model.layers[0].qkv_proj.max_rank)
        buffers.prepare_plans(packed)  # (rewrites of this layout skip the zero-fill)
        with torch.cuda.stream(stream):
            buffers.write(0, packed)
            buffers.clear(0)
        stream.synchronize()
    finally:
        pool.release(region)


def warm_layout(model: Any) -> tuple[dict, int]:
    """The full layout at the slots' rank (``slot_image.full_layout``: its entries, its
    elements); on a MoE model without expert storage (``max_expert_loras`` 0) without the
    expert modules, which no slot can take."""
    from loraplex.engine.model.lora.slot_image import full_layout
    from loraplex.engine.model.moe.lora_names import expert_module

    entries, numel = full_layout(model.cfg, model.layers[0].qkv_proj.max_rank)
    if getattr(model, "expert_loras", None) is not None and not model.expert_loras():
        entries = {k: e for k, e in entries.items() if expert_module(k[1]) is None}
    return entries, numel


class CompileWatch:
    """Counts Triton kernel compiles (including loads from Triton's disk cache) in this
    process; after ``serving()`` each is logged as a warning."""

    def __init__(self) -> None:
        self.compiles = 0
        self.while_serving: list[str] = []
        self.events: list[tuple[float, str]] = []  # (perf_counter, kernel) of every compile
        self._serving = False
        self._installed = False

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton (or too old for hooks): nothing compiles we could see
            return
        if self._installed:
            return
        prev = knobs.runtime.jit_post_compile_hook

        def hook(**kw: Any) -> Any:
            self.compiles += 1
            name = getattr(kw.get("fn"), "name", "?")
            self.events.append((time.perf_counter(), name))
            if self._serving:
                self.while_serving.append(name)
                log.warning("kernel_compiled_while_serving", kernel=name)
            return prev(**kw) if prev is not None else None

        knobs.runtime.jit_post_compile_hook = hook
        self._installed = True

    def starting(self) -> None:
        """An engine is starting (its compiles are expected)."""
        self._serving = False

    def serving(self) -> None:
        self._serving = True


COMPILES = CompileWatch()  # one per process: Triton's hook is process-wide
