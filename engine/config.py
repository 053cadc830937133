"""Engine configuration: one frozen dataclass, derived values as properties."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from loraplex.engine.errors import SpeculativeConfigError
from loraplex.engine.model.backend import KERNEL_BACKENDS

__all__ = [
    "ADAPTER_EVICTIONS",
    "EngineConfig",
    "MAX_SPECULATIVE_TOKENS",
    "QUANTIZATIONS",
    "SPECULATIVE_METHODS",
]

QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization, besides None (model/quant.py)
# EngineConfig.adapter_eviction: the names of adapters/eviction.py's POLICIES (this module may
# not import the adapters layer; a test keeps the two equal)
ADAPTER_EVICTIONS = ("lru", "lfu", "gdsf", "gdf")
SPECULATIVE_METHODS = ("ngram", "draft")  # EngineConfig.speculative_method, besides None
MAX_SPECULATIVE_TOKENS = 16  # num_speculative_tokens: 1..this
MAX_NGRAM = 64  # speculative_ngram_min / _max: 1..this


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF model dir; None -> the built-in demo model
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    served_model_name: str | None = None
    # base weights: None: as the checkpoint stores them (a pre-quantized fp8 checkpoint is read
    # as fp8); "fp8": the projections of a bf16/fp16/fp32 checkpoint are quantized to float8
    # e4m3 on load (per output channel); a caller's model (``AsyncEngine(config, model=...)``)
    # is quantized at start-up. On CUDA the projections run the fp8 GEMM, float rows freed.
    quantization: str | None = None
    # fp8 base on CUDA: projections of steps with at least this many tokens run W8A8
    # (activations quantized per token to e4m3, cuBLASLt's fp8 GEMM; kernels/fp8_w8a8.py)
    # instead of the weight-only kernel. "auto": each projection from the size where W8A8
    # measured faster (16-128 tokens, kernels/fp8_w8a8.py); None: weight-only at every size
    fp8_w8a8_min_tokens: int | str | None = "auto"
    # LoRA capacity
    max_loras: int = 4  # GPU slots (distinct adapters per step)
    max_cpu_loras: int = 8  # pinned host tier
    # which idle adapter a full tier gives up, one policy instance per tier (GPU slots, host
    # tier; adapters/eviction.py): lru | lfu (LFU with ageing) | gdsf | gdf (cost-aware
    # GreedyDual-Frequency). lru stays the default until the engine's own study decides
    adapter_eviction: str = "lru"
    max_lora_rank: int = 16
    max_adapter_bytes: int = 2 << 30
    # full-table slots for adapters whose modules_to_save replaces embed_tokens / lm_head
    # (model/lora/full.py): LoRA slots 0..N-1 also hold one (vocab, hidden) table per module; 0:
    # such adapters are refused (AdapterConfigError naming modules_to_save)
    max_full_module_loras: int = 0
    # expert-capable slots on a MoE base (model/moe/expert_lora.py): LoRA slots 0..N-1 also hold
    # expert LoRA storage (E * R * 3 * (H + I) elements per sparse layer a slot), the only ones
    # an adapter with LoRA on the experts takes; None: every slot; 0: such adapters are refused
    # (AdapterConfigError naming target_modules)
    max_expert_loras: int | None = None
    # rows past the base vocabulary that full tables may add (adapters that added tokens,
    # their own tokenizer.json): slots hold (vocab + N, hidden) tables and the logits are
    # vocab + N wide; 0: a table must have the base's rows (adapters/added_tokens.py)
    lora_extra_vocab_size: int = 0
    # scheduling
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    starvation_timeout_s: float = 10.0
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None  # None -> derived from kv_cache_fraction / kv_cache_bytes
    kv_cache_bytes: int | None = None  # CPU default: 256 MiB
    kv_cache_fraction: float = 0.85  # of free GPU memory after weights
    enable_prefix_caching: bool = True
    # CPU only: torch intra-op threads; None: one core fewer than the machine has (never more
    # than torch already uses), so the event loop and the step thread keep a core
    cpu_threads: int | None = None
    # which forward and LoRA kernels run: auto | fused | sgmv | torch (model/backend.py);
    # auto: fused on CUDA, torch on CPU
    kernel_backend: str = "auto"
    cuda_graphs: bool = True  # decode through captured CUDA graphs (GPU only)
    # decode batch sizes captured as graphs: a step replays the smallest that holds its rows,
    # a larger one runs eagerly; None: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to max_num_seqs
    # (cuda_graph.BUCKETS). Fewer sizes: a faster start-up, more padding rows per step
    cuda_graph_sizes: tuple[int, ...] | None = None
    # steps that mix decode rows with short prefill chunks (each <= 64 tokens, at most this many
    # tokens in all) replay CUDA graphs too (cold loads' short prompts don't stall streams);
    # 0: such steps run eagerly
    mixed_graph_tokens: int = 256
    # pipelined decode: queue the next decode step behind the running one, fed its sampled
    # tokens on the device, so host work overlaps GPU time (steady decode only)
    async_scheduling: bool = True
    # adapter sources
    local_roots: tuple[str, ...] = ()  # roots for file:// adapters (dynamic / admin loading)
    allow_sources: tuple[str, ...] = ()  # glob patterns of remote URIs dynamic names may use
    lora_name_template: str | None = None  # e.g. "s3://bucket/adapters/{name}": dynamic names
    enabled_plugins: tuple[str, ...] | None = None  # None: the built-in resolvers
    adapter_cache_dir: str | None = None  # where fetched adapters are staged (default: temp dir)
    # byte quota of the staging dir (LRU over idle versions; re-fetched when needed); None: no cap
    adapter_cache_bytes: int | None = None
    max_concurrent_loads: int = 4  # cold loads fetched / staged at once; others queue
    # a request whose adapter's slot write is issued in a step joins that very step (the step
    # waits on the write on the device) while the step's joined writes total at most this many
    # bytes and no earlier write is still landing; 0: requests wait for their write to land
    slot_write_join_bytes: int = 128 << 20
    # helper processes that fetch, verify, preflight and pack adapters (off this process's
    # GIL); None: 2 on CUDA, 0 (threads of this process) on CPU
    loader_processes: int | None = None
    gil_switch_interval_s: float | None = 0.0005  # None: leave sys.getswitchinterval() alone
    # structured output (structured/): a new constraint is first compiled in sandbox processes
    # (a crash there refuses it, the server lives on); one taking longer than this is refused
    # (None: no budget); compiled grammars kept up to this many bytes (least recently used
    # dropped first); sandbox processes compiling at once
    grammar_compile_timeout_s: float | None = 10.0
    grammar_cache_bytes: int = 1 << 30
    grammar_compile_processes: int = 2
    # ranks of tensor parallelism (model/tp.py, parallel/): this process is rank 0 and starts
    # N - 1 worker processes (one per GPU, NCCL; on CPU gloo); 1: one process, no collectives
    tensor_parallel_size: int = 1
    # speculative decoding (engine/spec/): None: off; "ngram": prompt lookup (the request's own
    # prompt and output propose); "draft": a small draft model (``speculative_model``, its HF
    # folder). A running row proposes up to ``num_speculative_tokens`` tokens, verified as one
    # (K + 1)-token row of the normal step (exact: greedy output token-identical, sampled output
    # distributed as without). A step speculates only while at most
    # ``speculative_max_running`` requests run (larger batches are compute bound: verifying K
    # extra tokens per row would cost more than it saves); such steps are not pipelined.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    speculative_model: str | None = None
    speculative_max_running: int = 8
    # per request (spec/backoff.py): after a verify step whose recent per-position acceptance
    # (accepted over tested proposed positions, decayed over its verify steps) is below this, the
    # request gets no proposals for 4, 8, ... 64 tokens (doubling while it keeps failing), then
    # one probe. 0.2 is the break-even of K = 4 at a verify step costing 1.25 decode steps
    # ((1 - a^5) / (1 - a) = 1.25); 0: always propose
    speculative_min_acceptance: float = 0.2
    # prompt lookup ("ngram"): the longest suffix of the request's tokens of ``max`` down to
    # ``min`` tokens that occurred earlier is matched (spec/ngram.py; why 1: its docstring)
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    # "draft": target adapter name -> the draft adapter folder its requests draft with (a
    # LoRA of the draft model; base requests and adapters not named draft with the draft's
    # base). Given as a mapping or (name, folder) pairs; kept as pairs sorted by name
    # (``draft_adapters``: the mapping)
    speculative_draft_adapters: tuple[tuple[str, str], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, "
                f"not {self.quantization!r}"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, "
                f"not {self.kernel_backend!r}"
            )
        if self.adapter_eviction not in ADAPTER_EVICTIONS:
            raise ValueError(
                f"adapter_eviction (--adapter-eviction) must be one of "
                f"{', '.join(ADAPTER_EVICTIONS)}, not {self.adapter_eviction!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.cuda_graph_sizes is not None:
            sizes = tuple(sorted(set(self.cuda_graph_sizes)))
            if not sizes or any(
                type(b) is not int or not 1 <= b <= self.max_num_seqs for b in sizes
            ):
                raise ValueError(
                    f"cuda_graph_sizes must be batch sizes in 1..max_num_seqs "
                    f"({self.max_num_seqs}), got {self.cuda_graph_sizes!r}"
                )
            object.__setattr__(self, "cuda_graph_sizes", sizes)
        if self.max_loras < 0 or self.max_cpu_loras < 0:
            raise ValueError("max_loras and max_cpu_loras must be >= 0")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if not 0 <= self.max_full_module_loras <= self.max_loras:
            raise ValueError(
                "max_full_module_loras must be between 0 and max_loras (full-table slots are "
                f"LoRA slots 0..N-1), got {self.max_full_module_loras} with max_loras "
                f"{self.max_loras}"
            )
        if self.max_expert_loras is not None and not 0 <= self.max_expert_loras <= self.max_loras:
            raise ValueError(
                "max_expert_loras must be between 0 and max_loras (expert-capable slots are "
                f"LoRA slots 0..N-1), got {self.max_expert_loras} with max_loras {self.max_loras}"
            )
        if self.lora_extra_vocab_size < 0:
            raise ValueError("lora_extra_vocab_size must be >= 0")
        if self.lora_extra_vocab_size and not self.max_full_module_loras:
            raise ValueError(
                "lora_extra_vocab_size needs full-table slots (max_full_module_loras > 0): "
                "only adapters with their own embed_tokens / lm_head tables can add tokens"
            )
        if self.max_full_module_loras and self.tensor_parallel_size > 1:
            raise ValueError(
                "max_full_module_loras is not supported with tensor_parallel_size > 1 (full "
                "embed_tokens / lm_head tables are not split over ranks)"
            )
        if self.loader_processes is not None and self.loader_processes < 0:
            raise ValueError("loader_processes must be >= 0")
        w8a8 = self.fp8_w8a8_min_tokens
        if w8a8 is not None and w8a8 != "auto" and not (type(w8a8) is int and w8a8 >= 1):
            raise ValueError(f"fp8_w8a8_min_tokens must be 'auto', None or >= 1, got {w8a8!r}")
        if self.grammar_compile_timeout_s is not None and not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be None or > 0")
        if self.grammar_cache_bytes < 1 or self.grammar_compile_processes < 1:
            raise ValueError("grammar_cache_bytes and grammar_compile_processes must be >= 1")
        if self.adapter_cache_bytes is not None and self.adapter_cache_bytes < 0:
            raise ValueError("adapter_cache_bytes must be >= 0")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                "max_cpu_loras must be >= max_loras (every GPU slot is backed by the CPU tier)"
            )
        self._check_speculative()

    def _check_speculative(self) -> None:
        """Speculative decoding: refuse what is not served (typed, naming the field)."""
        self._pairs_of_draft_adapters()
        k = self.num_speculative_tokens
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens (--num-speculative-tokens) must be an integer in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}",
                field="num_speculative_tokens",
            )
        if type(self.speculative_max_running) is not int or self.speculative_max_running < 1:
            raise SpeculativeConfigError(
                "speculative_max_running must be an integer >= 1", field="speculative_max_running"
            )
        a = self.speculative_min_acceptance
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a < 1.0:
            raise SpeculativeConfigError(
                f"speculative_min_acceptance (--speculative-min-acceptance) must be a number in "
                f"[0, 1) (0: no backoff), got {a!r}",
                field="speculative_min_acceptance",
            )
        lo, hi = self.speculative_ngram_min, self.speculative_ngram_max
        for name, n in (("speculative_ngram_min", lo), ("speculative_ngram_max", hi)):
            if type(n) is not int or not 1 <= n <= MAX_NGRAM:
                flag = "--" + name.replace("_", "-")
                raise SpeculativeConfigError(
                    f"{name} ({flag}) must be an integer in 1..{MAX_NGRAM}, got {n!r}", field=name
                )
        if lo > hi:
            raise SpeculativeConfigError(
                f"speculative_ngram_min ({lo}) must not exceed speculative_ngram_max ({hi})",
                field="speculative_ngram_min",
            )
        method = self.speculative_method
        if method is None:
            return
        if method not in SPECULATIVE_METHODS:
            raise SpeculativeConfigError(
                f"speculative_method (--speculative-method) must be None or one of "
                f"{', '.join(SPECULATIVE_METHODS)}, not {method!r}",
                field="speculative_method",
            )
        if self.tensor_parallel_size > 1:
            raise SpeculativeConfigError(
                "speculative decoding is not supported with tensor_parallel_size > 1 (the "
                "verification step is not replayed on the worker ranks)",
                field="speculative_method",
            )
        if self.quantization == "fp8":
            raise SpeculativeConfigError(
                "speculative decoding is not supported with an fp8 base (quantization='fp8'): "
                "fp8 projections pick their GEMM by step size, so a verification row would not "
                "compute the tokens a decode step computes",
                field="speculative_method",
            )
        if method == "draft" and not self.speculative_model:
            raise SpeculativeConfigError(
                "speculative_method 'draft' needs speculative_model (--speculative-model DIR): "
                "the draft model's HF folder",
                field="speculative_model",
            )
        if self.speculative_draft_adapters and method != "draft":
            raise SpeculativeConfigError(
                "speculative_draft_adapters (--speculative-draft-adapter) need "
                "speculative_method 'draft'",
                field="speculative_draft_adapters",
            )

    def _pairs_of_draft_adapters(self) -> None:
        """``speculative_draft_adapters`` as (name, folder) pairs sorted by name; a mapping is
        taken too. Names must be distinct non-empty strings, folders paths."""
        given = self.speculative_draft_adapters
        items = list(given.items()) if isinstance(given, Mapping) else list(given)
        pairs: dict[str, str] = {}
        for item in items:
            ok = isinstance(item, tuple | list) and len(item) == 2
            name, folder = item if ok else (None, None)
            if not (isinstance(name, str) and name and isinstance(folder, str | os.PathLike)):
                raise SpeculativeConfigError(
                    f"speculative_draft_adapters: want target adapter name -> draft adapter "
                    f"folder, got {item!r}",
                    field="speculative_draft_adapters",
                )
            if name in pairs:
                raise SpeculativeConfigError(
                    f"speculative_draft_adapters: {name!r} is given twice",
                    field="speculative_draft_adapters",
                )
            pairs[name] = os.fspath(folder)
        object.__setattr__(self, "speculative_draft_adapters", tuple(sorted(pairs.items())))

    @property
    def draft_adapters(self) -> dict[str, str]:
        """``speculative_draft_adapters`` as a mapping: target adapter name -> folder."""
        return dict(self.speculative_draft_adapters)

    @property
    def resolved_loader_processes(self) -> int:
        if self.loader_processes is not None:
            return self.loader_processes
        return 2 if self.resolved_device.startswith("cuda") else 0

    @property
    def expert_slots(self) -> int:
        """LoRA slots that hold expert LoRA storage on a MoE base (``max_expert_loras``)."""
        return self.max_loras if self.max_expert_loras is None else self.max_expert_loras

    @property
    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device
