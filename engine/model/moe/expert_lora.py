"""LoRA on the experts: one sparse block's slots and the delta of every (token, chosen expert,
adapter slot) triple, never a merged weight.

Slots (R = max_lora_rank, L = max_loras; rank-r adapters fill rows / columns < r, zeros
beyond)::

    a_gate_up: (L, E, 2R, H)   rows 0 .. R: the expert's gate A, R .. 2R: its up A
    b_gate_up: (L, E, 2I, R)   rows 0 .. I: gate B (scale folded in), I .. 2I: up B
    a_down:    (L, E, R, I)
    b_down:    (L, E, H, R)

A slot costs E * R * 3 * (H + I) elements per sparse layer (docs/architecture.md). PEFT's fused
form has one A for gate_up: it is written into both halves (model/moe/lora_names.py).

Semantics (``expert_lora_delta_torch`` is this loop, grouped by (slot, expert))::

    for p in range(P):                                  # pair p = token * k + j
        s = slots[p // a_div_tokens]; e = experts[p]
        if s < 0: continue                              # a base row
        h = x[p // a_div] @ a[s, e].T                   # (S * R,) S slices: 2 (gate, up) or 1
        for i in range(S):                              # slice i: output rows i*N/S ..
            out[p, i*N/S : (i+1)*N/S] += h[i*R : (i+1)*R] @ b[s, e, i*N/S : (i+1)*N/S].T

in float32, rounded once into ``out``'s dtype. The gate_up delta is added before SiLU * up,
the down delta before the routing weight (``grouped_gemm.moe_experts``).
"""

from __future__ import annotations

import torch

__all__ = ["ExpertLoRA", "expert_lora_delta", "expert_lora_delta_torch"]


class ExpertLoRA(torch.nn.Module):
    """One sparse block's expert LoRA slots (module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        width: int,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        e, r, h, i, n = num_experts, max_rank, hidden, width, max_loras
        kw = {"dtype": dtype, "device": device}
        self.max_rank, self.max_loras, self.width = r, n, i
        self.register_buffer("a_gate_up", torch.zeros(n, e, 2 * r, h, **kw))
        self.register_buffer("b_gate_up", torch.zeros(n, e, 2 * i, r, **kw))
        self.register_buffer("a_down", torch.zeros(n, e, r, i, **kw))
        self.register_buffer("b_down", torch.zeros(n, e, h, r, **kw))
        # host-side: slots that may hold non-zero expert weights (a clear skips the others:
        # attention-only adapters on a MoE model pay no expert writes)
        self.dirty: set[int] = set()

    @property
    def slot_bytes(self) -> int:
        """Device bytes one slot's expert LoRA takes in this block."""
        bufs = (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down)
        return sum(t[0].numel() * t.element_size() for t in bufs)

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        if slot in self.dirty:
            for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down):
                t[slot].zero_()
            self.dirty.discard(slot)

    @torch.no_grad()
    def set(
        self, slot: int, role: str, expert: int | None, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        """Write one module's pairs into ``slot`` (cleared before, ``clear``): ``role`` gate_up
        / down with ``expert`` None (PEFT's fused form: A (r*E, in), B (out, r*E), expert e's
        column j of B at j*E + e), or gate / up / down of one ``expert`` (A (r, in), B (out, r))."""
        self.dirty.add(slot)
        big_r, i = self.max_rank, self.width
        if expert is None:
            e_count = self.a_down.shape[1]
            r = a.shape[0] // e_count
            a3 = a.reshape(e_count, r, a.shape[1])  # (E, r, in)
            b3 = b.reshape(b.shape[0], r, e_count).permute(2, 0, 1)  # (E, out, r)
            if role == "gate_up":
                self.a_gate_up[slot, :, :r].copy_(a3, non_blocking=True)
                self.a_gate_up[slot, :, big_r : big_r + r].copy_(a3, non_blocking=True)
                self.b_gate_up[slot, :, :, :r].copy_(b3, non_blocking=True)
            else:
                self.a_down[slot, :, :r].copy_(a3, non_blocking=True)
                self.b_down[slot, :, :, :r].copy_(b3, non_blocking=True)
            return
        r = a.shape[0]
        if role == "down":
            self.a_down[slot, expert, :r].copy_(a, non_blocking=True)
            self.b_down[slot, expert, :, :r].copy_(b, non_blocking=True)
            return
        half = 0 if role == "gate" else 1
        self.a_gate_up[slot, expert, half * big_r : half * big_r + r].copy_(a, non_blocking=True)
        self.b_gate_up[slot, expert, half * i : (half + 1) * i, :r].copy_(b, non_blocking=True)


def expert_lora_delta_torch(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    experts: torch.Tensor,
    pair_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    a_div: int,
) -> None:
    """The torch twin: the module docstring's loop, one pair of matmuls per (slot, expert)
    group. ``pair_slots``: (P,) the slot of each pair's token. Host syncs (CPU path, tests)."""
    n_slices = a.shape[2] // b.shape[3]
    r = b.shape[3]
    width = out.shape[1] // n_slices
    live = (pair_slots >= 0).nonzero().squeeze(1)
    if live.numel() == 0:
        return
    keys = pair_slots[live].long() * a.shape[1] + experts[live].long()
    for key in torch.unique(keys).tolist():
        s, e = divmod(key, a.shape[1])
        pairs = live[keys == key]
        h = x.index_select(0, pairs // a_div).float() @ a[s, e].float().t()  # (n, S*R)
        delta = torch.cat(
            [
                h[:, j * r : (j + 1) * r] @ b[s, e, j * width : (j + 1) * width].float().t()
                for j in range(n_slices)
            ],
            dim=1,
        )
        out.index_copy_(0, pairs, (out.index_select(0, pairs).float() + delta).to(out.dtype))


def expert_lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    experts: torch.Tensor,
    pair_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    a_div: int,
    triton: bool,
) -> None:
    """``out`` += the delta of the module docstring. ``triton``: a graph-safe form without
    host syncs (a gather of every pair's slot weights; the grouped Triton kernel over the
    expert-sorted pairs is issue 42's next step), else the twin."""
    if not triton:
        expert_lora_delta_torch(x, a, b, experts, pair_slots, out, a_div=a_div)
        return
    n_slices = a.shape[2] // b.shape[3]
    r = b.shape[3]
    live = pair_slots >= 0
    s = pair_slots.clamp(min=0).long()
    e = experts.long()
    rows = x.index_select(0, torch.arange(out.shape[0], device=x.device) // a_div)
    h = torch.einsum("pk,pnk->pn", rows.float(), a[s, e].float())  # (P, S*R)
    h = h * live[:, None]
    hb = h.view(-1, n_slices, r)
    bb = b[s, e].float().view(out.shape[0], n_slices, -1, r)  # (P, S, N/S, R)
    delta = torch.einsum("psr,psnr->psn", hb, bb).reshape(out.shape[0], -1)
    out.copy_((out.float() + delta).to(out.dtype))
