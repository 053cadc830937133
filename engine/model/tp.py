"""Tensor parallelism (Megatron layout): what each rank holds, and the collectives of a step.

A rank's model is the family's own model built from ``shard_config``: the heads, KV heads,
MLP width and vocabulary of its shard, the hidden size whole. Checkpoint tensors are cut by
``shard_tensor`` as they load, adapters by ``shard_adapter`` before they are packed, so the
slot writes, kernels and CUDA graphs of one GPU run unchanged on a shard.

| weight                          | split                      | after the projection           |
|---------------------------------|----------------------------|--------------------------------|
| q_proj, k_proj, v_proj (qkv)    | output rows (heads)        | attention on the rank's heads  |
| gate_proj, up_proj (gate_up)    | output rows                | SiLU-and-mul on the rank's cols|
| o_proj, down_proj               | input columns              | all-reduce (sum) of the output |
| embed_tokens, lm_head           | vocabulary rows (padded)   | all-reduce / all-gather        |
| norms                           | whole                      |                                |

Biases follow their rows; a row-parallel layer's bias lives on rank 0 only (the all-reduce
adds it once). With fewer KV heads than ranks (GQA), each KV head is replicated on the ranks
whose query heads read it (the rank count must be a multiple of the KV heads).

LoRA sharded to match, without a collective of its own: a column-parallel layer keeps A whole
and the rows of B of its outputs; a row-parallel layer keeps the columns of A of its inputs
and B whole. Its shrink is then a partial sum (x_rank @ A_rank^T), and the GPU path all-
reduces the augmented GEMM's output, [base partials | shrink partials], in one collective
before the epilogue expands it: the rank-r partial products travel in the all-reduce the base
output needs anyway (S * L * R extra columns: 128 against 4096 for o_proj at 8 slots of rank
16). The reference path expands locally and all-reduces the sum (the same value: the expand
is linear).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loraplex.engine.model.config import ModelConfig

__all__ = [
    "TPShard",
    "TensorParallel",
    "shard_config",
    "shard_tensor",
    "shard_lora",
    "shard_adapter",
    "vocab_range",
    "TensorParallelError",
    "full_config",
]


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks (or this feature is not split yet)."""


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise TensorParallelError(f"rank {self.rank} of {self.size} ranks")


def _check(cfg: ModelConfig, size: int) -> None:
    if cfg.moe is not None:  # (before any other field: the experts are not split at all)
        raise TensorParallelError(
            f"mixture-of-experts models ({cfg.architecture}) are not split over ranks yet: "
            "use tensor_parallel_size 1"
        )
    if cfg.num_heads % size:
        raise TensorParallelError(f"{cfg.num_heads} attention heads do not split over {size} ranks")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise TensorParallelError(
            f"{cfg.num_kv_heads} KV heads over {size} ranks: one must divide the other"
        )
    if cfg.intermediate_size % size:
        raise TensorParallelError(
            f"intermediate size {cfg.intermediate_size} does not split over {size} ranks"
        )
    if cfg.quantization is not None:
        raise TensorParallelError("fp8 checkpoints are not split over ranks yet")


def vocab_range(vocab_size: int, shard: TPShard) -> tuple[int, int, int]:
    """(first row, end row, rows per rank) of ``shard``'s vocabulary slice; the last rank's
    slice may run short of the padded per-rank size (the padding rows stay zero)."""
    per = -(-vocab_size // shard.size)
    lo = min(shard.rank * per, vocab_size)
    return lo, min(lo + per, vocab_size), per


def _kv_heads(cfg: ModelConfig, shard: TPShard) -> tuple[int, int]:
    """(first KV head, count) of ``shard``."""
    if cfg.num_kv_heads >= shard.size:
        per = cfg.num_kv_heads // shard.size
        return shard.rank * per, per
    return shard.rank * cfg.num_kv_heads // shard.size, 1  # replicated


def shard_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config of one rank's model: its heads, KV heads, MLP width and vocabulary."""
    if shard.size == 1:
        return cfg
    _check(cfg, shard.size)
    _, n_kv = _kv_heads(cfg, shard)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // shard.size,
        num_kv_heads=n_kv,
        intermediate_size=cfg.intermediate_size // shard.size,
        vocab_size=vocab_range(cfg.vocab_size, shard)[2],
    )


def _out_rows(cfg: ModelConfig, module: str, shard: TPShard) -> tuple[int, int] | None:
    """Output rows [lo, hi) a column-parallel module keeps on ``shard``; None: row-parallel."""
    d = cfg.head_dim
    if module == "q_proj":
        per = cfg.num_heads // shard.size * d
        return shard.rank * per, (shard.rank + 1) * per
    if module in ("k_proj", "v_proj"):
        first, n = _kv_heads(cfg, shard)
        return first * d, (first + n) * d
    if module in ("gate_proj", "up_proj"):
        per = cfg.intermediate_size // shard.size
        return shard.rank * per, (shard.rank + 1) * per
    return None


def _in_cols(cfg: ModelConfig, module: str, shard: TPShard) -> tuple[int, int]:
    """Input columns [lo, hi) a row-parallel module (o_proj, down_proj) keeps on ``shard``."""
    width = cfg.q_size if module == "o_proj" else cfg.intermediate_size
    per = width // shard.size
    return shard.rank * per, (shard.rank + 1) * per


_PROJ = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, shard: TPShard) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` (HF key, full model ``cfg``) that ``shard``
    holds, shaped as in the rank's model."""
    if shard.size == 1:
        return t
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        lo, hi, per = vocab_range(cfg.vocab_size, shard)
        out = t.new_zeros((per, *t.shape[1:]))
        out[: hi - lo] = t[lo:hi]
        return out
    m = _PROJ.search(name)
    if m is None:
        return t  # norms and anything else whole
    module, kind = m.groups()
    rows = _out_rows(cfg, module, shard)
    if rows is not None:
        return t[rows[0] : rows[1]]
    if kind == "bias":  # row-parallel: added once, after the all-reduce, by rank 0
        return t if shard.rank == 0 else torch.zeros_like(t)
    lo, hi = _in_cols(cfg, module, shard)
    return t[:, lo:hi]


def shard_lora(
    module: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig, shard: TPShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's LoRA (A (r, in), B (out, r)) as ``shard`` holds it (module docstring)."""
    if shard.size == 1:
        return a, b
    rows = _out_rows(cfg, module, shard)
    if rows is not None:
        return a, b[rows[0] : rows[1]]
    lo, hi = _in_cols(cfg, module, shard)
    return a[:, lo:hi], b


def shard_adapter(adapter: Any, cfg: ModelConfig, shard: TPShard) -> Any:
    """A copy of ``adapter`` (``LoRAAdapter`` with plain weights) with every module's tensors
    cut for ``shard`` (contiguous), ready for the rank's slot writes."""
    from loraplex.engine.model.lora.weights import LoRAWeights

    if shard.size == 1:
        return adapter
    if getattr(adapter, "dora", None):
        raise TensorParallelError(f"adapter {adapter.name!r}: DoRA is not split over ranks yet")
    if any(layer < 0 for layer, _ in adapter.weights):
        raise TensorParallelError(
            f"adapter {adapter.name!r}: embed_tokens / lm_head LoRA is not split over ranks yet"
        )
    weights = {}
    for (layer, module), w in adapter.weights.items():
        a, b = shard_lora(module, w.a, w.b, cfg, shard)
        weights[(layer, module)] = LoRAWeights(a.contiguous(), b.contiguous())
    return dataclasses.replace(adapter, weights=weights)


def full_config(model: Any) -> ModelConfig:
    """The whole model's config: ``model.cfg`` is its shard's on a tensor-parallel rank. What
    sees adapters, prompts and slot images (adapter checks, vocabulary, packing layout, the
    host pool) reads this; what sizes the rank's own tensors (KV cache, layers) ``model.cfg``."""
    tp = getattr(model, "tp", None)
    return tp.cfg if tp is not None else model.cfg


class TensorParallel:
    """A rank's place in its group and the collectives its forward runs (``torch.distributed``:
    NCCL on CUDA, gloo on CPU). ``cfg`` is the full model's config."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, group: Any = None) -> None:
        self.cfg = cfg
        self.shard = shard
        self.group = group

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the output of a row-parallel projection)."""
        if self.shard.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: rows of ids in this rank's slice, zeros elsewhere, summed."""
        lo, hi, _ = vocab_range(self.cfg.vocab_size, self.shard)
        mine = (input_ids >= lo) & (input_ids < hi)
        x = torch.nn.functional.embedding(torch.where(mine, input_ids - lo, 0), table)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """(N, vocab / size) logits of this rank's slice -> (N, vocab) on every rank."""
        if self.shard.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.cfg.vocab_size]
