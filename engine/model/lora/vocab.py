"""Slot-stacked LoRA of the model-level targets: the input embedding and the LM head.

Both are a LoRA "linear" with one slice and no base weight of their own (the base table stays
the model's ``embed_tokens`` / ``lm_head``, tied or not: an LM head LoRA on a tied model is its
own delta, as in PEFT)::

    lora_a: (1, L, R, in)     zero beyond each adapter's rank
    lora_b: (L, out, R)       LoRA scale folded in; stored (L, R, out) like LoRALinear's

embed_tokens: in = vocab, out = hidden. PEFT's ``lora_embedding_A`` (r, vocab) is A and
``lora_embedding_B`` (hidden, r) is B: delta[t] = A[:, ids[t]] @ B^T (columns of A gathered by
token id; no dropout). lm_head: in = hidden, out = vocab, delta[t] = (h[t] @ A^T) @ B^T added to
the logits. Slot writes treat them as sites of layer ``VOCAB_LAYER`` (slot_buffers.py, slot_image.py).
"""

from __future__ import annotations

import torch

from loraplex.engine.model.lora.ops.vocab import lora_vocab_expand

__all__ = ["VocabLoRA", "mark_vocab_slot"]


class VocabLoRA(torch.nn.Module):
    def __init__(
        self,
        name: str,
        in_features: int,
        out_features: int,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.slice_names = (name,)
        self.slice_offsets = (0, out_features)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.slot_writes = (
            0  # per-module writes (set_lora / reset_lora): slot_buffers.py's zero state
        )
        self.dora_scale = None  # DoRA is refused on these targets (targets.py)
        kw = {"dtype": dtype, "device": device}
        self.register_buffer("lora_a", torch.zeros(1, max_loras, max_rank, in_features, **kw))
        # (L, out, R) stored (L, R, out), as LoRALinear's (layers.py): slot writes copy rows
        lora_b = torch.zeros(max_loras, max_rank, out_features, **kw).permute(0, 2, 1)
        self.register_buffer("lora_b", lora_b)
        # slots whose adapter has this module (the expand skips the others' rows: their B is
        # zero); written with the slot, on the writer's stream; ``_on`` mirrors it on the host
        self.register_buffer("lora_on", torch.zeros(max_loras, dtype=torch.int32, device=device))
        self._on: set[int] = set()

    def mark(self, slot: int, on: bool) -> None:
        """Flag ``slot`` as holding this module's LoRA or not (a launch only on a change)."""
        if (slot in self._on) == on:
            return
        self.lora_on[slot].fill_(int(on))
        if on:
            self._on.add(slot)
        else:
            self._on.discard(slot)

    def slice_index(self, module: str) -> int:
        return self.slice_names.index(module)

    def set_lora(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write A (r, in) and scaled B (out, r) into ``slot``."""
        r = a.shape[0]
        self.slot_writes += 1
        self.lora_a[0, slot, :r].copy_(a, non_blocking=True)
        self.lora_a[0, slot, r:].zero_()
        self.lora_b[slot, :, :r].copy_(b, non_blocking=True)
        self.lora_b[slot, :, r:].zero_()
        self.mark(slot, True)

    def reset_lora(self, slot: int, module: str | None = None) -> None:
        self.slot_writes += 1
        self.lora_a[:, slot].zero_()
        self.lora_b[slot].zero_()
        self.mark(slot, False)

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """(T, L*R): every slot's ``x @ A^T``; for the embedding ``x`` is the token ids (T,)
        and the shrink gathers A's columns (= ``onehot(ids) @ A^T``)."""
        L, R = self.max_loras, self.max_rank
        a = self.lora_a.view(L * R, self.in_features)
        if self.name == "embed_tokens":
            return a.index_select(1, x).t().contiguous()  # NOTE: strides fixed (kernel variants)
        return x @ a.t()

    def add(self, y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, *, triton: bool):
        """y (T, out) += each row's delta (rows of slot -1 unchanged)."""
        if self.max_loras == 0:
            return
        lora_vocab_expand(y, self.shrink(x), self.lora_b, token_slots, self.lora_on, triton=triton)


def mark_vocab_slot(vocab: dict[str, VocabLoRA], slot: int, modules: set[str]) -> None:
    """After a packed slot write (slot_buffers.py): flag ``slot`` in each vocab module the adapter
    has (``modules``), clear it in the others."""
    for name, mod in vocab.items():
        mod.mark(slot, name in modules)
