"""How much memory serving a model takes, from config.json and safetensors headers alone.

``loraplex serve ... --dry-run`` prints it as a table (no weights are loaded or, for a remote
model, downloaded); a normal ``serve`` logs it as one ``memory_estimate`` line at start-up.
The sizes come from the engine's own sizing: the KV bytes of a block
(``ModelRunner.kv_bytes_per_block``), a LoRA slot image (``lora.staging.slot_image_numel``:
every target module of every layer, the embedding and LM head included, at
``--max-lora-rank``), full-table slots (``lora.full.full_slot_bytes``), the host pool and the
GPU headroom of start-up (``startup.host_pool``, ``GPU_HEADROOM``).

The KV line is what ``--max-num-seqs`` sequences of ``--max-model-len`` tokens need; the engine
itself gives the KV cache ``kv_cache_fraction`` of the GPU memory left after the weights.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from loraplex.engine.server.model_files import ModelMetadata

if TYPE_CHECKING:
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_config", "format_table", "FP8_GPUS"]

FP8_MIN_CAPABILITY = (8, 9)
FP8_GPUS = "Ada (L4, L40S, RTX 4090), Hopper (H100, H200), Blackwell (B200, RTX 5090)"
_PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
_FP8 = ("F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    where: str
    device: str
    dtype: str
    fp8: str | None  # None, "on load" (--quantization fp8) or "checkpoint"
    tensor_parallel_size: int
    params: int
    files: int
    checkpoint_bytes: int
    weight_bytes: int  # per GPU (tensor parallel: an even share)
    load_bytes: int  # the weights while loading (fp8 bases load as float rows first)
    buffer_bytes: int  # RoPE tables (float32) and the slots' DoRA row scales
    fp8_weight_bytes: int  # the weights with --quantization fp8
    layers: int
    kv_heads: int  # per GPU
    head_dim: int
    kv_bytes_per_token: int
    max_num_seqs: int
    max_model_len: int
    kv_bytes: int
    max_loras: int
    max_lora_rank: int
    lora_slot_bytes: int  # one GPU slot, a MoE model's expert storage included
    full_slots: int
    full_bytes: int
    headroom_bytes: int
    host_pool_bytes: int
    gpu: str | None  # this machine's CUDA device, when there is one
    gpu_capability: tuple[int, int] | None
    gpu_bytes: int | None
    kv_policy: str  # how the engine itself sizes its KV cache
    expert_slot_bytes: int = 0  # of ``lora_slot_bytes``: a MoE model's experts
    expert_slots: int | None = None  # slots that hold the experts (--max-expert-loras; None: all)
    # speculative decoding's draft model (--speculative-method draft): its weights, and its KV
    # cache for the KV line's tokens plus the drafted ones (spec/draft.py)
    draft_weight_bytes: int = 0
    draft_kv_bytes: int = 0
    # loads in this process's threads (no loader processes): at most, the chunk buffers of
    # every concurrent load until its staging copy is written (adapters/pass_chunks.py)
    load_buffer_bytes: int = 0

    @property
    def lora_bytes(self) -> int:
        """Every slot's dense LoRA, and the experts' storage in the expert-capable slots."""
        experts = self.max_loras if self.expert_slots is None else self.expert_slots
        dense = self.lora_slot_bytes - self.expert_slot_bytes
        return self.max_loras * dense + experts * self.expert_slot_bytes

    @property
    def total_bytes(self) -> int:
        """What one GPU needs: the steady state, or the load peak when that is larger."""
        fixed = self.lora_bytes + self.full_bytes + self.buffer_bytes + self.headroom_bytes
        draft = self.draft_weight_bytes + self.draft_kv_bytes
        return max(self.weight_bytes + self.kv_bytes, self.load_bytes) + fixed + draft

    def log_fields(self) -> dict[str, Any]:
        return {
            "model": self.model, "device": self.device, "dtype": self.dtype, "fp8": self.fp8,
            "params": self.params, "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_bytes": self.kv_bytes,
            "kv_tokens": self.max_num_seqs * self.max_model_len,
            "lora_bytes": self.lora_bytes + self.full_bytes, "buffer_bytes": self.buffer_bytes,
            "headroom_bytes": self.headroom_bytes, "total_bytes": self.total_bytes,
            "total": human_bytes(self.total_bytes),
        }  # fmt: skip


def _weights(meta: ModelMetadata, elem: int, fp8: bool, cuda: bool) -> tuple[int, int]:
    """(steady bytes, bytes while loading) of the served weights. Projections held in fp8
    take 1 byte a value and a float32 scale a row; on CUDA their float rows are freed after
    loading, on CPU they stay beside the fp8 ones."""
    steady = load = 0
    for t in meta.tensors:
        if t.name.endswith(("_scale", "_scale_inv")) and t.dtype == "F32":
            steady += t.nbytes
            load += t.nbytes
            continue
        as_float = t.numel * elem
        if _PROJECTION.search(t.name) and (fp8 or t.dtype in _FP8):
            rows = t.shape[0] if t.shape else 1
            fp8_bytes = t.numel + 4 * rows
            steady += fp8_bytes if cuda else as_float + fp8_bytes
            load += as_float + fp8_bytes
        else:
            steady += as_float
            load += as_float
    return steady, load


def estimate_memory(meta: ModelMetadata, config: EngineConfig, model: str) -> MemoryEstimate:
    """The estimate for serving ``meta`` with ``config`` (its device, dtype, slots, limits)."""
    import torch

    from loraplex.engine.adapters import pass_chunks
    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.model.loader import resolve_dtype
    from loraplex.engine.model.lora.full import full_slot_bytes
    from loraplex.engine.model.lora.slot_image import slot_image_numel
    from loraplex.engine.model.tp import TPShard, shard_config
    from loraplex.engine.model_runner import ModelRunner
    from loraplex.engine.startup import GPU_HEADROOM

    mcfg = ModelConfig.from_dict(meta.config)
    device = config.resolved_device
    cuda = device.startswith("cuda")
    dtype = resolve_dtype(config.dtype, mcfg, device)
    elem = torch.empty((), dtype=dtype).element_size()
    tp = config.tensor_parallel_size
    rank_cfg = shard_config(mcfg, TPShard(0, tp))  # one GPU's heads, MLP width and vocabulary
    fp8 = "on load" if config.quantization == "fp8" else None
    if mcfg.quantization is not None:
        fp8 = "checkpoint"
    steady, load = _weights(meta, elem, fp8 is not None, cuda)
    # NOTE: the runner's own sizing reads only ``cfg`` and ``dtype`` of the model it is given
    shape_only = cast("CausalLM", SimpleNamespace(cfg=rank_cfg, dtype=dtype))
    per_block = ModelRunner.kv_bytes_per_block(shape_only, config.block_size)
    max_len = min(
        config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
    )
    blocks = config.max_num_seqs * math.ceil(max_len / config.block_size)
    slot = slot_image_numel(rank_cfg, config.max_lora_rank) * elem
    # RoPE cos and sin tables (model/rope.py), and each projection's DoRA row scales for
    # every slot and the base (model/lora/layers.py: dora_scale, (L + 1, N))
    rope = 2 * mcfg.max_position_embeddings * mcfg.head_dim * 4
    rows = sum(out for _, out in rank_cfg.lora_module_shapes().values())
    dora = rank_cfg.num_layers * (config.max_loras + 1) * rows * elem if config.max_loras else 0
    full = config.max_full_module_loras * full_slot_bytes(
        mcfg.vocab_size, mcfg.hidden_size, dtype, config.lora_extra_vocab_size
    )
    # of it, a MoE model's expert LoRA storage (model/moe/expert_lora.py: per sparse layer A
    # and B of gate_up and down for each expert at the full rank, E * R * 3 * (H + I); the slot
    # image counts the same elements in its per-expert layout)
    moe = mcfg.moe
    experts = (
        len(moe.sparse_layers) * moe.num_experts * config.max_lora_rank * 3
        * (mcfg.hidden_size + moe.expert_size) * elem
        if moe is not None else 0
    )  # fmt: skip
    # the host pool of start-up (startup.host_pool; every engine with LoRA slots): a full-rank
    # slot image per region, pinned on CUDA, pre-faulted on the CPU
    regions = max(config.max_cpu_loras, config.max_loras) + max(1, config.max_concurrent_loads)
    host = regions * slot_image_numel(mcfg, config.max_lora_rank) * elem if config.max_loras else 0
    draft_weights, draft_kv = _draft(config, dtype, elem, cuda, blocks * config.block_size)
    threads = config.max_loras and config.resolved_loader_processes == 0
    # at most: every concurrent load's kept chunks and ring, until its copy is written
    ring = pass_chunks.RING * pass_chunks.CHUNK_BYTES
    loads = max(1, config.max_concurrent_loads)
    buffers = max(loads, pass_chunks.KEEP_RINGS) * ring + loads * pass_chunks.RETAIN_BYTES
    gpu = cap = gpu_bytes = None
    if cuda and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device).index or 0)
        gpu, cap, gpu_bytes = props.name, (props.major, props.minor), int(props.total_memory)
    return MemoryEstimate(
        model=model, where=meta.where, device=device,
        dtype=str(dtype).removeprefix("torch."), fp8=fp8, tensor_parallel_size=tp,
        params=sum(t.numel for t in meta.tensors if not t.name.endswith(("_scale", "_scale_inv"))),
        files=meta.files, checkpoint_bytes=sum(t.nbytes for t in meta.tensors),
        weight_bytes=steady // tp, load_bytes=load // tp, buffer_bytes=rope + dora,
        fp8_weight_bytes=_weights(meta, elem, True, True)[0] // tp,
        layers=mcfg.num_layers, kv_heads=rank_cfg.num_kv_heads, head_dim=mcfg.head_dim,
        kv_bytes_per_token=per_block // config.block_size, max_num_seqs=config.max_num_seqs,
        max_model_len=max_len, kv_bytes=blocks * per_block, max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank, lora_slot_bytes=slot,
        full_slots=config.max_full_module_loras, full_bytes=full,
        headroom_bytes=GPU_HEADROOM if cuda else 0, host_pool_bytes=host,
        gpu=gpu, gpu_capability=cap, gpu_bytes=gpu_bytes, kv_policy=_kv_policy(config, cuda),
        expert_slot_bytes=experts, expert_slots=config.max_expert_loras,
        load_buffer_bytes=buffers if threads else 0,
        draft_weight_bytes=draft_weights, draft_kv_bytes=draft_kv,
    )  # fmt: skip


def _draft(
    config: EngineConfig, dtype: Any, elem: int, cuda: bool, kv_tokens: int
) -> tuple[int, int]:
    """(weights, KV) bytes of the draft model (a local folder; 0, 0 without one): at the served
    model's dtype, its KV blocks for ``kv_tokens`` tokens and K drafted ones per sequence."""
    if config.speculative_method != "draft" or not config.speculative_model:
        return 0, 0
    from pathlib import Path

    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.server.model_files import local_metadata
    from loraplex.engine.spec.draft import draft_kv_blocks, draft_kv_bytes_per_block

    meta = local_metadata(Path(config.speculative_model))
    blocks = draft_kv_blocks(
        kv_tokens, config.block_size, config.max_num_seqs, config.num_speculative_tokens
    )
    per_block = draft_kv_bytes_per_block(
        ModelConfig.from_dict(meta.config), dtype, config.block_size
    )
    return _weights(meta, elem, False, cuda)[0], blocks * per_block


def estimate_config(
    config: EngineConfig,
    *,
    remote: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
) -> MemoryEstimate:
    """The estimate of serving ``config`` (its model a local folder, or with ``remote`` also
    a Hub id or S3 URI read without downloading its weights: ``--dry-run``)."""
    from pathlib import Path

    from loraplex.engine.server.model_files import local_metadata
    from loraplex.engine.server.model_source import model_metadata

    if remote or config.model is None:
        meta = model_metadata(config, revision=revision, download_dir=download_dir)
    else:
        meta = local_metadata(Path(config.model))
    return estimate_memory(meta, config, config.served_model_name or config.model or "model")


def _kv_policy(config: EngineConfig, cuda: bool) -> str:
    """How start-up sizes the KV cache (startup._build), in words."""
    from loraplex.engine.startup import CPU_KV_BYTES

    if config.num_kv_blocks is not None:
        return f"{config.num_kv_blocks} blocks (num_kv_blocks)"
    if config.kv_cache_bytes is not None:
        return f"{human_bytes(config.kv_cache_bytes)} (kv_cache_bytes)"
    if cuda:
        return f"{config.kv_cache_fraction:.0%} of the GPU memory free after the weights"
    return f"{human_bytes(CPU_KV_BYTES)} on CPU"


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _fp8_line(e: MemoryEstimate) -> str:
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    text = f"fp8 kernels need compute capability >= {need}: {FP8_GPUS}"
    if e.gpu is not None and e.gpu_capability is not None:
        ok = e.gpu_capability >= FP8_MIN_CAPABILITY
        cap = ".".join(map(str, e.gpu_capability))
        text += f"; this GPU ({e.gpu}, {cap}) {'has them' if ok else 'has not'}"
    return text


def format_table(e: MemoryEstimate) -> str:
    """The ``--dry-run`` report: one row per item, then the total."""
    place = "CPU memory" if e.device == "cpu" else "GPU memory"
    per_gpu = f" per GPU of {e.tensor_parallel_size}" if e.tensor_parallel_size > 1 else ""
    rows = [
        ("model", f"{e.model}" + (f"  ({e.where})" if e.where != e.model else "")),
        ("device, dtype", f"{e.device}, {e.dtype}" + (f", fp8 weights ({e.fp8})" if e.fp8 else "")),
        ("parameters", f"{_count(e.params)} in {e.files} safetensors file(s), "
                       f"{human_bytes(e.checkpoint_bytes)} on disk"),
        ("weights", human_bytes(e.weight_bytes) + per_gpu),
    ]  # fmt: skip
    if e.load_bytes > e.weight_bytes:
        rows.append(("weights while loading", human_bytes(e.load_bytes) + " (float rows first)"))
    rows += [
        ("KV cache per token", f"{human_bytes(e.kv_bytes_per_token)} ({e.layers} layers x "
                               f"{e.kv_heads} KV heads x {e.head_dim} x K,V x {e.dtype})"),
        ("KV cache", f"{human_bytes(e.kv_bytes)} for {e.max_num_seqs} sequences x "
                     f"{e.max_model_len} tokens (--max-num-seqs x --max-model-len)"),
    ]  # fmt: skip
    if e.expert_slot_bytes and e.expert_slots is not None:
        dense = e.lora_slot_bytes - e.expert_slot_bytes
        rows.append(("LoRA slots", f"{human_bytes(e.lora_bytes)} = {e.max_loras} (--max-loras) x "
                     f"{human_bytes(dense)} (rank {e.max_lora_rank}, every projection, embedding "
                     f"and LM head) + {e.expert_slots} (--max-expert-loras) x "
                     f"{human_bytes(e.expert_slot_bytes)} (the experts)"))  # fmt: skip
    else:
        rows.append(("LoRA slots", f"{human_bytes(e.lora_bytes)} = {e.max_loras} (--max-loras) x "
                     f"{human_bytes(e.lora_slot_bytes)} (rank {e.max_lora_rank}, every "
                     "projection, embedding and LM head"
                     + (f"; {human_bytes(e.expert_slot_bytes)} of it the experts" if
                        e.expert_slot_bytes else "") + ")"))  # fmt: skip
    rows.append(("RoPE, DoRA scales", human_bytes(e.buffer_bytes)))
    if e.full_slots:
        rows.append(("full-table slots", f"{human_bytes(e.full_bytes)} = {e.full_slots} slots"))
    if e.draft_weight_bytes:
        rows.append(("draft model", f"weights {human_bytes(e.draft_weight_bytes)}, KV cache "
                                    f"{human_bytes(e.draft_kv_bytes)} (--speculative-model)"))  # fmt: skip
    if e.headroom_bytes:
        rows.append(("headroom", f"{human_bytes(e.headroom_bytes)} (activations, CUDA graphs, "
                                 "workspaces)"))  # fmt: skip
    rows.append((f"total {place}", human_bytes(e.total_bytes) + per_gpu))
    if e.gpu is not None and e.gpu_bytes is not None:
        fits = "fits" if e.total_bytes <= e.gpu_bytes else "does NOT fit"
        rows.append(("this GPU", f"{e.gpu}, {human_bytes(e.gpu_bytes)}: {fits}"))
    if e.host_pool_bytes:
        rows.append(("pinned host memory", f"{human_bytes(e.host_pool_bytes)} (CPU adapter tier)"))
    if e.load_buffer_bytes:
        rows.append(("load buffers", f"up to {human_bytes(e.load_buffer_bytes)} (host; adapter "
                                     "loads in threads)"))  # fmt: skip
    if e.fp8 is None:
        rows.append(("with --quantization fp8", f"weights {human_bytes(e.fp8_weight_bytes)}"))
    rows.append(("fp8", _fp8_line(e)))
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    note = (
        "  The KV line is what --max-num-seqs sequences of --max-model-len tokens need; the "
        f"engine's KV cache takes {e.kv_policy}."
    )
    return "\n".join(["loraplex memory estimate (no weights loaded)", *lines, note])
