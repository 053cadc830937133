"""Engine start-up: load the model, size the KV cache, load the tokenizer, report capacity.

``AsyncEngine`` calls ``build_core`` (in its step thread) and ``capacity_report``; this module
imports the core, the core never imports it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog
import torch

from loraplex.engine.adapters.host_pool import HostPool
from loraplex.engine.adapters.slot_writer import InlineWriter, SlotWriter, ThreadWriter
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.errors import SpeculativeConfigError
from loraplex.engine.mixed_graphs import MixedGraphs
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.kernels.fp8_linear import prepare_fp8_linear
from loraplex.engine.model.kernels.fp8_w8a8 import (
    prepare_w8a8,
    w8a8_auto_min_tokens,
    w8a8_device_ok,
    w8a8_supported,
)
from loraplex.engine.model.loader import load_model, resolve_dtype
from loraplex.engine.model.lora.full import attach_full_modules, full_slot_bytes
from loraplex.engine.model.lora.slot_image import slot_image_numel
from loraplex.engine.model.protocol import CausalLM
from loraplex.engine.model.quant import drop_float_bases, fp8_layers, quantize_model
from loraplex.engine.model.tp import TensorParallelError, full_config
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.parallel import ParallelRunner, WorkerGroup
from loraplex.engine.spec.draft import DraftProposer
from loraplex.engine.spec.draft_start import draft_blocks_for, load_draft, split_kv_budget
from loraplex.engine.structured.bitmask import warm_bitmask
from loraplex.engine.tokenizer import Tokenizer, TokenizerError
from loraplex.engine.warmup import COMPILES, warm_eager_steps, warm_slot_writes

log = structlog.get_logger("loraplex.engine")

__all__ = ["build_core", "capacity_report", "check_model_slots"]

CPU_KV_BYTES = 256 << 20
GPU_HEADROOM = 2 << 30  # activations, CUDA-graph pool, cuBLAS workspaces, slot staging


def build_core(
    config: EngineConfig, wake: Callable[[], None], model: CausalLM | None = None
) -> EngineCore:
    """Load model, KV cache and tokenizer (blocking: call from a worker thread).

    ``model``: an already built model (benchmarks, apps that make their own weights);
    then ``config.model`` may name a folder with only config.json / tokenizer files. Its LoRA
    slots must match the config (``check_model_slots``).

    ``config.tensor_parallel_size`` N > 1: this process is rank 0; it starts the N - 1 workers
    (``parallel.WorkerGroup``), which load their shards while it loads its own, and runs steps
    through a ``ParallelRunner``. A failed start-up stops the workers.
    """
    if model is not None:
        check_model_slots(model, config)
        if config.tensor_parallel_size > 1:
            raise TensorParallelError(
                "a caller-supplied model is not split over ranks: name its folder in "
                "config.model instead"
            )
    if config.model is None and model is None:
        from loraplex.engine.demo import demo_model_dir

        # the built-in demo model is served as "demo" unless named (its folder is no name)
        name = config.served_model_name or "demo"
        config = replace(config, model=str(demo_model_dir()), served_model_name=name)
    group = None
    if config.tensor_parallel_size > 1:  # rank 0 of N (parallel/): this process
        assert config.model is not None
        mcfg = ModelConfig.from_dir(config.model)
        dtype = resolve_dtype(config.dtype, mcfg, config.resolved_device)
        group = WorkerGroup(config, config.model, mcfg, dtype)
    try:
        return _build(config, wake, model, group)
    except BaseException:
        if group is not None:
            group.close()
        raise


def _build(
    config: EngineConfig, wake: Callable[[], None], model: CausalLM | None, group: Any
) -> EngineCore:
    device = config.resolved_device
    if device == "cpu":
        set_cpu_threads(group.threads if group is not None else config.cpu_threads)
    path = Path(config.model) if config.model is not None else None
    if model is None:
        assert path is not None
        mcfg = ModelConfig.from_dir(path)
        model = load_model(
            path,
            dtype=resolve_dtype(config.dtype, mcfg, device),
            device=device,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            quantization=config.quantization,
            tensor_parallel=group.start() if group is not None else None,
            max_expert_loras=config.max_expert_loras,
        )
    if config.max_full_module_loras and getattr(model, "full_modules", None) is None:
        # before the KV cache is sized from the free memory (model/lora/full.py)
        attach_full_modules(model, config.max_full_module_loras, config.lora_extra_vocab_size)
    if config.quantization == "fp8":
        quantize_model(model)  # a caller's float model (a loaded one is fp8 already)
    if config.speculative_method is not None and fp8_layers(model):
        raise SpeculativeConfigError(
            "speculative decoding is not supported with an fp8 base (this checkpoint's "
            "projections are fp8): fp8 projections pick their GEMM by step size, so a "
            "verification row would not compute the tokens a decode step computes",
            field="speculative_method",
        )
    if model.device.type == "cuda" and fp8_layers(model):
        drop_float_bases(model)  # before anything holds lora_a; memory counted for KV below
        prepare_fp8_linear(model.device)  # split-K counters, before any graph capture
    set_w8a8_thresholds(model, config.fp8_w8a8_min_tokens)
    tokenizer = None  # token-id prompts only
    if path is not None:
        with contextlib.suppress(TokenizerError):
            tokenizer = Tokenizer.from_dir(path)
    # the draft model's weights (speculative_method "draft"), before the free memory is read
    draft = load_draft(config, model, tokenizer) if config.speculative_method == "draft" else None
    # each worker's free GPU memory once its shard is loaded (None on CPU)
    frees = [m[1] for m in group.wait_all("loaded")] if group is not None else []
    num_blocks, draft_blocks = kv_blocks(config, model, frees, draft)
    if num_blocks < 2:
        raise ValueError(f"KV cache too small: {num_blocks} blocks")
    max_len = min(
        config.max_model_len or model.cfg.max_position_embeddings,
        model.cfg.max_position_embeddings,
    )
    kw = dict(
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_model_len=max_len,
        use_cuda_graphs=config.cuda_graphs,
        max_graph_batch=config.max_num_seqs,
        graph_sizes=config.cuda_graph_sizes,
        kernel_backend=config.kernel_backend,
    )
    runner = ModelRunner(model, **kw) if group is None else ParallelRunner(group, model, **kw)
    COMPILES.install()
    COMPILES.starting()
    if runner.graphs is not None:
        t0 = time.perf_counter()
        runner.graphs.capture_all()  # NOTE: a bucket captured mid-serving stalls its step 1-3 s
        log.info("cuda_graphs_captured", buckets=list(runner.graphs.buckets),
                 rank_buckets=list(runner.graphs.rank_buckets),
                 seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
    mixed = None
    if runner.graphs is not None and config.mixed_graph_tokens > 0:
        t0 = time.perf_counter()
        mixed = MixedGraphs(
            model,
            runner.kv_caches,
            block_size=config.block_size,
            max_blocks_per_seq=runner.graphs.tables.shape[1],
            seq_buckets=runner.graphs.buckets,
            max_tokens=min(config.mixed_graph_tokens, config.max_num_batched_tokens),
            pool=runner.graphs.pool,
            # verification steps (speculative decoding) as graphs of their own
            verify_k=config.num_speculative_tokens if config.speculative_method else 0,
            verify_seqs=config.speculative_max_running,
            max_step_tokens=config.max_num_batched_tokens,
        )
        mixed.capture_all()
        log.info("mixed_graphs_captured", buckets=len(mixed.buckets),
                 verify_buckets=len(mixed.wide_buckets), seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
    if runner.fused and model.device.type == "cuda":
        # other mixed prefill + decode steps run eagerly: compile their kernel variants now
        warm_eager_steps(runner, config.max_num_batched_tokens, config.max_num_seqs, max_len)
    if draft is not None:
        start_draft(config, draft, draft_blocks)
    logits_width = full_config(model).vocab_size + config.lora_extra_vocab_size
    warm_bitmask(logits_width, config.max_num_seqs, model.device)  # (CUDA only)
    procs = config.resolved_loader_processes if config.max_loras else 0
    pool = host_pool(config, model)
    writer = slot_writer(config, runner, pool)
    core = EngineCore(
        config, model, runner, tokenizer, wake, pool=pool, mixed_graphs=mixed, writer=writer,
        proposer=draft,
    )  # fmt: skip
    core.adapters.fetcher.start_processes(procs)
    return core


def kv_blocks(
    config: EngineConfig, model: CausalLM, frees: list[int], draft: DraftProposer | None
) -> tuple[int, int]:
    """(the target's KV blocks, the draft's) from ``num_kv_blocks`` (the target's; the draft's
    follow from it), else from a byte budget (``kv_cache_bytes``; on CUDA a fraction of the free
    memory, TP: of the rank with the least; on the CPU 256 MiB) that holds both caches."""
    per_block = ModelRunner.kv_bytes_per_block(model, config.block_size)
    if config.num_kv_blocks is not None:
        n = config.num_kv_blocks
        return n, draft_blocks_for(config, n) if draft is not None else 0
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    elif model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        free = min([free, *frees])  # TP: the rank with the least sizes every rank's cache
        budget = int(max(free - GPU_HEADROOM, 0) * config.kv_cache_fraction)
    else:
        budget = CPU_KV_BYTES
    if draft is None:
        return budget // per_block, 0
    return split_kv_budget(config, budget, per_block, draft)


def start_draft(config: EngineConfig, draft: DraftProposer, num_blocks: int) -> None:
    """The draft's KV cache and graphs; on CUDA with the fused forward its eager step shapes
    (catch-up prefill chunks) compiled now, not while serving."""
    draft.allocate(num_blocks)
    runner = draft.runner
    assert runner is not None
    if runner.fused and runner.device.type == "cuda":
        warm_eager_steps(runner, config.max_num_batched_tokens, config.max_num_seqs, draft.max_len)
    log.info("draft_model", model=config.speculative_model, kv_blocks=num_blocks,
             adapters=len(config.speculative_draft_adapters))  # fmt: skip


def slot_writer(config: EngineConfig, runner: ModelRunner, pool: HostPool | None) -> SlotWriter:
    """The engine's slot writer (adapters/slot_writer.py): a thread and side stream on CUDA
    with one rank and a host pool (warmed now: one full-size write and a clear), else writes
    inline in the step thread (the CPU, tensor parallelism)."""
    device = runner.device
    if device.type == "cuda" and runner.tp_size == 1 and pool is not None and config.max_loras:
        stream = torch.cuda.Stream(device)
        warm_slot_writes(runner.slot_buffers, pool, stream)
        return ThreadWriter(runner.write_slot, stream, pool)
    return InlineWriter(runner.write_slot, pool)


def check_model_slots(model: CausalLM, config: EngineConfig) -> None:
    """A caller-supplied model must have ``config.max_loras`` LoRA slots of rank
    ``config.max_lora_rank`` (the rank of a model without slots is not checked): adapter
    checks, slot writes and the host pool are sized from the config."""
    if model.max_loras != config.max_loras:
        raise ValueError(
            f"the model has {model.max_loras} LoRA slots but the config asks for "
            f"max_loras={config.max_loras}: build the model with max_loras={config.max_loras}"
        )
    full = getattr(model, "full_modules", None)
    if full is not None and full.num != config.max_full_module_loras:
        raise ValueError(
            f"the model has {full.num} full-table slots but the config asks for "
            f"max_full_module_loras={config.max_full_module_loras}"
        )
    if full is not None and full.extra != config.lora_extra_vocab_size:
        raise ValueError(
            f"the model's full-table slots have {full.extra} extra rows but the config asks "
            f"for lora_extra_vocab_size={config.lora_extra_vocab_size}"
        )
    blocks = getattr(model, "expert_loras", list)()
    have = blocks[0][1].max_loras if blocks else 0
    if getattr(model, "sparse_blocks", None) is not None and have != config.expert_slots:
        raise ValueError(
            f"the model has {have} expert-capable LoRA slots but the config asks for "
            f"{config.expert_slots} (max_expert_loras={config.max_expert_loras}): build the "
            f"model with max_expert_loras={config.max_expert_loras}"
        )
    if model.max_loras and model.max_lora_rank != config.max_lora_rank:
        raise ValueError(
            f"the model's LoRA slots have rank {model.max_lora_rank} but the config asks for "
            f"max_lora_rank={config.max_lora_rank}: build the model with "
            f"max_lora_rank={config.max_lora_rank}"
        )


def set_cpu_threads(threads: int | None) -> int:
    """torch's intra-op threads for a CPU engine. On a 2-core machine, 2 OpenMP threads next to
    a busy event loop made decode gaps jump from ~9 ms to 110-170 ms (the workers spin at every
    barrier while the loop holds one of their cores); one core fewer avoids that."""
    if threads is None:
        threads = min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) - 1))
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads()


def host_pool(config: EngineConfig, model: CausalLM) -> HostPool | None:
    """The CPU tier's host memory, allocated once, here: ``max_cpu_loras`` +
    ``max_concurrent_loads`` regions of one full-rank slot image each; on CUDA registered
    (pinned), on the CPU pre-faulted (a load's pack into a fresh buffer costs a page fault
    per 4 KiB: ~1.7 x the sha256 time of the adapter's bytes, more than the pack itself).
    None without LoRA slots."""
    cuda = model.device.type == "cuda"
    if not config.max_loras:
        return None
    elem = torch.empty((), dtype=model.dtype).element_size()
    region = slot_image_numel(full_config(model), config.max_lora_rank) * elem
    count = max(config.max_cpu_loras, config.max_loras) + max(1, config.max_concurrent_loads)
    t0 = time.perf_counter()
    pool = HostPool(region, count, register_cuda=cuda, prefault=not cuda)
    log.info("host_pool", regions=count, region_bytes=pool.region_bytes, bytes=pool.nbytes,
             seconds=round(time.perf_counter() - t0, 3))  # fmt: skip
    return pool


def capacity_report(core: EngineCore) -> dict[str, Any]:
    """What the engine holds: KV tokens, GPU slots, CPU tier, adapters the host memory fits."""
    cfg = core.config
    mcfg = core.model_config
    shapes = mcfg.adapter_module_shapes()  # the embedding's and the LM head's included
    elem = torch.empty((), dtype=core.model.dtype).element_size()
    full_rank_bytes = sum(i + o for i, o in shapes.values()) * cfg.max_lora_rank * elem
    num_blocks = core.blocks.num_blocks
    return {
        "model": core.model_name,
        "device": str(core.device),
        "dtype": str(core.model.dtype).removeprefix("torch."),
        "kv_blocks": num_blocks,
        "kv_tokens": num_blocks * cfg.block_size,
        "gpu_slots": cfg.max_loras,
        "max_lora_rank": cfg.max_lora_rank,
        "slot_bytes": full_rank_bytes,
        # modules_to_save: slots 0..N-1 also hold a full embed_tokens and lm_head table each
        "full_module_slots": cfg.max_full_module_loras,
        "full_module_bytes": cfg.max_full_module_loras
        * full_slot_bytes(
            mcfg.vocab_size, mcfg.hidden_size, core.model.dtype, cfg.lora_extra_vocab_size
        ),
        "cpu_tier_adapters": cfg.max_cpu_loras,
        "cpu_tier_bytes_at_max_rank": full_rank_bytes * cfg.max_cpu_loras,
        "adapters_fitting_host_memory": _host_bytes() // max(full_rank_bytes, 1),
        **_expert_capacity(cfg, mcfg, elem),
    }


def _expert_capacity(cfg: EngineConfig, mcfg: Any, elem: int) -> dict[str, int]:
    """A MoE base: the slots that hold expert LoRA (``max_expert_loras``) and the bytes of
    one at the full rank (per sparse layer A and B of gate_up and down for every expert:
    model/moe/expert_lora.py), beside ``slot_bytes`` (attention and dense layers)."""
    moe = getattr(mcfg, "moe", None)
    if moe is None or not cfg.max_loras:
        return {}
    per_slot = len(moe.sparse_layers) * moe.num_experts * cfg.max_lora_rank * 3
    per_slot *= (mcfg.hidden_size + moe.expert_size) * elem
    return {"expert_slots": cfg.expert_slots, "expert_slot_bytes": per_slot}


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def set_w8a8_thresholds(model: Any, setting: int | str | None) -> None:
    """Each fp8 projection's ``w8a8_min_tokens`` from ``EngineConfig.fp8_w8a8_min_tokens``
    (``auto``: the measured per-projection table; an int: every projection; None: none), then
    the GEMM's unit scale, before any graph capture. Per-channel scales only: other layers stay
    weight-only. ``auto`` on a device without fp8 tensor cores keeps weight-only; an explicit
    count there is refused."""
    lins = fp8_layers(model)
    if setting is None or not lins:
        return
    if not w8a8_device_ok(model.device):
        if setting == "auto":
            log.info("w8a8_unavailable", device=str(model.device), reason="no fp8 tensor cores")
            return
        raise ValueError(
            f"fp8_w8a8_min_tokens={setting}: W8A8 needs fp8 tensor cores (compute capability "
            f"8.9+), {model.device} has none; leave it 'auto' or None"
        )
    for lin in lins:
        if w8a8_supported(lin.weight_fp8, lin.weight_scale):
            auto = setting == "auto"
            lin.w8a8_min_tokens = w8a8_auto_min_tokens(lin.slice_names) if auto else setting
    prepare_w8a8(model.device)
