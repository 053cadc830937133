"""Full-table slots: adapters whose PEFT ``modules_to_save`` replaces ``embed_tokens`` and / or
``lm_head`` with a whole (vocab, hidden) table of their own.

A separate, smaller pool next to the LoRA slots: ``max_full_module_loras`` = F slots, tied to
LoRA slots 0..F-1 (the manager gives an adapter with full tables only such a slot; its LoRA
modules sit in the same slot index as any adapter's). Per module::

    embed / head: (F, V, H)   the adapter's table (model dtype)
    on:           (2, F)      int32, 1 where slot f holds a table of module 0 (embed) / 1 (head)

A row whose slot f < F has ``on`` set takes its embedding from ``embed[f]`` instead of the
base table (a gather by token id) and its logits from ``h @ head[f].T`` instead of the base
head (``ops/full_head.py``). Both read only device tensors (CUDA graphs); with F = 0 no model
has this module and the step path is what it was. The tables are independent of each other and
of the base tying: on a tied model an adapter may replace only one of them, as in PEFT.

With ``extra`` = E > 0 (``lora_extra_vocab_size``, adapters/added_tokens.py) the tables are
(F, V + E, H): an adapter that added k <= E tokens holds V + k rows (the rest zero) and
``limit[f]`` = V + k. Ids up to V + E - 1 then reach the model: the base embedding and its
LoRA read them clamped to V - 1 (``base_ids``; only that adapter's rows carry such ids, and
its own table replaces those rows). The logits are V + E wide (``widen_logits``): base
logits padded, a full head's rows written whole, then -inf at ids >= V in every row except
a full-head slot's, whose rows get -inf at ids >= ``limit[f]``. With E = 0 none of this
exists and the shapes and ops are those above.
"""

from __future__ import annotations

import torch

from loraplex.engine.model.lora.ops.full_head import full_head

__all__ = ["FULL_MODULES", "FullModules", "attach_full_modules", "full_slot_bytes"]

FULL_MODULES = ("embed_tokens", "lm_head")


def full_slot_bytes(vocab: int, hidden: int, dtype: torch.dtype, extra: int = 0) -> int:
    """Device bytes of one full-table slot (both modules; ``extra`` rows past the vocab)."""
    rows = vocab + extra
    return len(FULL_MODULES) * rows * hidden * torch.empty((), dtype=dtype).element_size()


class FullModules(torch.nn.Module):
    def __init__(
        self,
        num: int,
        vocab: int,
        hidden: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        extra: int = 0,
    ) -> None:
        super().__init__()
        if num < 1:
            raise ValueError("full-table slots: num must be >= 1")
        if extra < 0:
            raise ValueError("full-table slots: extra must be >= 0")
        self.num = num
        self.vocab, self.extra = vocab, extra  # the base's rows, rows adapters may add
        kw = {"dtype": dtype, "device": device}
        self.register_buffer("embed", torch.zeros(num, vocab + extra, hidden, **kw))
        self.register_buffer("head", torch.zeros(num, vocab + extra, hidden, **kw))
        if extra:
            # the ids a full-head slot's rows may sample: [0, limit[f]) (V + the tokens added)
            i32 = {"dtype": torch.int32, "device": device}
            self.register_buffer("limit", torch.full((num,), vocab, **i32))
            self.register_buffer("cols", torch.arange(vocab + extra, **i32))
        self.register_buffer("on", torch.zeros(len(FULL_MODULES), num, dtype=torch.int32,
                                               device=device))  # fmt: skip
        # host mirror of ``on`` (eager CPU steps skip the work while no slot holds a table)
        self.held: tuple[set[int], set[int]] = (set(), set())

    def _table(self, i: int) -> torch.Tensor:
        return self.embed if i == 0 else self.head

    @torch.no_grad()
    def write(self, slot: int, tables: dict[str, torch.Tensor]) -> None:
        """Slot ``slot`` holds ``tables`` (module -> (V, H)); modules not in it hold none.
        Issued on the current stream (the slot writes' side stream)."""
        if not 0 <= slot < self.num:
            raise IndexError(f"full-table slot {slot} out of range [0, {self.num})")
        for i, module in enumerate(FULL_MODULES):
            t = tables.get(module)
            if t is not None and self.extra:
                rows = t.shape[0]
                if not self.vocab <= rows <= self.vocab + self.extra:
                    raise ValueError(f"{module}: {rows} rows for slots of {self.vocab} + "
                                     f"{self.extra}")  # fmt: skip
                self._table(i)[slot, :rows].copy_(t, non_blocking=True)
                self._table(i)[slot, rows:].zero_()
            elif t is not None:
                self._table(i)[slot].copy_(t, non_blocking=True)
            if t is not None:
                self.on[i, slot].fill_(1)
                self.held[i].add(slot)
            else:
                self.on[i, slot].fill_(0)
                self.held[i].discard(slot)
            if self.extra and i == 1:
                self.limit[slot].fill_(self.vocab if t is None else t.shape[0])

    def _skip(self, i: int, x: torch.Tensor) -> bool:
        # NOTE: on CUDA the ops always run (the graphs capture them; their kernels compile
        # during warm-up), on CPU only while some slot holds a table of the module
        return x.device.type != "cuda" and not self.held[i]

    def embed_rows(self, x: torch.Tensor, ids: torch.Tensor, token_slots: torch.Tensor) -> None:
        """x (T, H) in place: rows of a slot with a full embedding take its rows by id."""
        if self._skip(0, x):
            return
        s = token_slots.long()
        f = s.clamp(0, self.num - 1)
        use = (s >= 0) & (s < self.num) & (self.on[0].index_select(0, f) != 0)  # (T,)
        rows = self.embed[f, ids]  # (T, H) gather
        x.copy_(torch.where(use[:, None], rows, x))

    def base_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` for the base embedding (and its LoRA): with extra rows, clamped below V (an
        added id's row comes from its adapter's table, ``embed_rows``)."""
        return ids.clamp(max=self.vocab - 1) if self.extra else ids

    def widen_logits(
        self,
        y: torch.Tensor,
        h: torch.Tensor,
        token_slots: torch.Tensor | None,
        *,
        triton: bool,
    ) -> torch.Tensor:
        """With extra rows: (N, V) base logits (LM head LoRA deltas added) -> (N, V + E), a
        full head's rows computed whole, -inf where a row's tokenizer has no id (see the
        module docstring). Device tensors only (CUDA graphs)."""
        out = torch.nn.functional.pad(y, (0, self.extra))
        if token_slots is None:  # base rows only
            out[:, self.vocab :] = float("-inf")
            return out
        if not self._skip(1, out):
            full_head(out, h, self.head, self.on[1], token_slots, triton=triton)
        s = token_slots.long()
        f = s.clamp(0, self.num - 1)
        own = (s >= 0) & (s < self.num) & (self.on[1].index_select(0, f) != 0)  # (N,)
        lim = torch.where(own, self.limit.index_select(0, f), self.vocab)
        return out.masked_fill_(self.cols[None, :] >= lim[:, None], float("-inf"))

    def head_logits(
        self, y: torch.Tensor, h: torch.Tensor, token_slots: torch.Tensor, *, triton: bool
    ) -> None:
        """y (N, V) logits in place: rows of a slot with a full LM head get ``h @ head^T``."""
        if self._skip(1, y):
            return
        full_head(y, h, self.head, self.on[1], token_slots, triton=triton)


def attach_full_modules(model: torch.nn.Module, num: int, extra: int = 0) -> FullModules | None:
    """Give ``model`` ``num`` full-table slots (``model.full_modules``) with ``extra`` rows
    past the vocabulary for added tokens; 0 slots: none."""
    if num <= 0:
        model.full_modules = None
        return None
    cfg = model.cfg
    fm = FullModules(
        num, cfg.vocab_size, cfg.hidden_size, dtype=model.dtype, device=model.device, extra=extra
    )
    model.full_modules = fm
    return fm
