"""What the engine needs from a model: the ``CausalLM`` protocol.

Engine modules outside ``engine/model`` name this protocol, never a model class; models are
built through the registry (``registry.py``) by ``loader.build_model`` / ``loader.load_model``.
A family implements it with LoRA-capable projections (``LoRALinear``), one per fused group of
original modules.

Who reads what:

- model runner: ``cfg``, ``dtype``, ``device``, ``max_loras``, ``set_base_layout``, the
  reference forward (``__call__``) and ``compute_logits``;
- slot writes and the host tier (``model/lora/slot_buffers.py``, ``model/lora/slot_image.py``): ``lora_linears`` and
  ``lora_vocab`` (the embedding's and the LM head's LoRA slots);
- the fused GPU forward (``fused.py``), CUDA graphs and warm-up: ``layers`` and ``lm_head``,
  and the Llama layer attributes that ``fused.py`` lists (a family with another layer
  structure runs the reference forward: kernel backends ``torch`` / ``sgmv``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from loraplex.engine.model.attention import AttentionMetadata
    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.model.lora.full import FullModules
    from loraplex.engine.model.lora.layers import LoRALinear
    from loraplex.engine.model.lora.mapping import LoRAMapping
    from loraplex.engine.model.lora.vocab import VocabLoRA

__all__ = ["CausalLM"]


@runtime_checkable
class CausalLM(Protocol):
    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    layers: torch.nn.ModuleList  # decoder layers, each with its LoRALinear projections
    lm_head: torch.Tensor  # (vocab, hidden)
    full_modules: FullModules | None  # modules_to_save tables (model/lora/full.py); None: none

    @property
    def max_loras(self) -> int:
        """GPU adapter slots of every LoRA layer (0: no LoRA buffers)."""
        ...

    @property
    def max_lora_rank(self) -> int:
        """Rank R of the slot buffers."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        mapping: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """Reference forward. input_ids, positions: (T,) -> final hidden states (T, hidden),
        reading and writing the paged KV cache (one (k, v) pair per layer)."""
        ...

    def compute_logits(
        self, hidden: torch.Tensor, mapping: LoRAMapping | None = None
    ) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32; ``mapping``: the N rows' slots (LM head LoRA)."""
        ...

    def lora_vocab(self) -> dict[str, VocabLoRA]:
        """Model-level LoRA slots by module (``embed_tokens``, ``lm_head``; model/lora/vocab.py)."""
        ...

    def lora_linears(self) -> Iterator[tuple[int, dict[str, LoRALinear]]]:
        """Per layer: original module name (``q_proj``, ...) -> the layer holding its slice."""
        ...

    def set_base_layout(self, transposed: bool) -> None:
        """Base weights stored (in, out) for the reference forward on CPU, or (out, in)."""
        ...
