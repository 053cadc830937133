"""LoRA on the experts: one sparse block's slots and the delta of every (token, chosen expert,
adapter slot) triple, never a merged weight.

Slots (R = max_lora_rank, L = the expert-capable slots: ``max_expert_loras``, default
max_loras; LoRA slots 0 .. L-1 hold expert storage, rows of slots >= L read none, as rank 0;
rank-r adapters fill rows / columns < r, zeros beyond)::

    a_gate_up: (L, E, 2R, H)   rows 0 .. R: the expert's gate A, R .. 2R: its up A
    b_gate_up: (L, E, R, 2I)   B^T: columns 0 .. I: gate B (scale folded in), I .. 2I: up B
    a_down:    (L, E, R, I)
    b_down:    (L, E, R, H)    B^T

B is held transposed, rank-major as the dense slots (lora/layers.py): each rank row of B^T is
contiguous, so that a slot write copies the packed image's B^T rows as they are (one batched
scatter, ``lora/slot_buffers.py``) and the expand kernel reads whole rows of output columns.

A slot costs E * R * 3 * (H + I) elements per sparse layer (docs/architecture.md). PEFT's fused
form has one A for gate_up: it is written into both halves (model/moe/lora_names.py).

Semantics (``expert_lora_delta_torch`` is this loop, grouped by (slot, expert))::

    for p in range(P):                                  # pair p = token * k + j
        s = token_slots[p // top_k]; e = experts[p]
        if s < 0 or s >= L or ranks[s] == 0: continue   # a base row; a slot without experts
        r = ranks[s]                                    # the slot's largest expert rank
        h = x[p // a_div] @ a[s, e, rows i*R .. i*R + r].T      # (S * r,) S slices: 2 or 1
        for i in range(S):                              # slice i: output rows i*N/S ..
            out[p, i*N/S : (i+1)*N/S] += h[i*r : (i+1)*r] @ b[s, e, :r, i*N/S : (i+1)*N/S]

in float32, rounded once into ``out``'s dtype; a skipped pair's ``out`` row keeps its bits. The
gate_up delta is added before SiLU * up, the down delta before the routing weight
(``grouped_gemm.moe_experts``). ``ranks`` (L,) int32 on the device: what ``set`` / ``clear``
leave in each slot (0: no expert weights), so that a step skips slots of attention-only
adapters and reads no rank column past a slot's rank.

On the GPU (``triton=True``) the Triton kernels of ``triton_expert_lora.py`` compute it over
the grouped GEMM's expert-sorted blocks (no host sync: CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from loraplex.engine.model.moe.pairs import sort_pairs
from loraplex.engine.model.moe.routing import ExpertBlocks

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
        self.register_buffer("b_gate_up", torch.zeros(n, e, r, 2 * i, **kw))
        self.register_buffer("a_down", torch.zeros(n, e, r, i, **kw))
        self.register_buffer("b_down", torch.zeros(n, e, r, h, **kw))
        self.register_buffer("ranks", torch.zeros(n, dtype=torch.int32, device=device))
        self._ranks = [0] * n  # the host's copy of ``ranks`` (no read back)
        # host-side: slots that may hold non-zero expert weights (a clear skips the others:
        # attention-only adapters on a MoE model pay no expert writes)
        self.dirty: set[int] = set()

    @property
    def slot_bytes(self) -> int:
        """Device bytes one slot's expert LoRA takes in this block."""
        bufs = (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down)
        return sum(t[0].numel() * t.element_size() for t in bufs)

    def holds(self, slot: int) -> bool:
        """``slot`` has expert storage here (LoRA slots past ``max_loras`` have none)."""
        return 0 <= slot < self.max_loras

    def _check(self, slot: int) -> None:
        if not self.holds(slot):
            raise ValueError(
                f"LoRA slot {slot} holds no expert storage (expert-capable slots: 0 .. "
                f"{self.max_loras - 1}, max_expert_loras)"
            )

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """``slot``'s experts zeroed (a slot past the expert-capable ones holds none: no-op)."""
        if not self.holds(slot):
            self.dirty.discard(slot)
            return
        if slot in self.dirty:
            for t in (self.a_gate_up, self.b_gate_up, self.a_down, self.b_down):
                t[slot].zero_()
            self.dirty.discard(slot)
            self._set_rank(slot, 0)

    def _set_rank(self, slot: int, rank: int) -> None:
        if self._ranks[slot] != rank:
            self._ranks[slot] = rank
            self.ranks[slot].fill_(rank)

    @torch.no_grad()
    def set(
        self, slot: int, role: str, expert: int | None, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        """Write one module's pairs into ``slot`` (cleared before, ``clear``): ``role`` gate_up
        / down with ``expert`` None (PEFT's fused form: A (r*E, in), B (out, r*E), expert e's
        column j of B at j*E + e), or gate / up / down of one ``expert`` (A (r, in), B (out, r))."""
        self._check(slot)
        self.dirty.add(slot)
        big_r, i = self.max_rank, self.width
        if expert is None:
            e_count = self.a_down.shape[1]
            r = a.shape[0] // e_count
            self._set_rank(slot, max(self._ranks[slot], r))
            a3 = a.reshape(e_count, r, a.shape[1])  # (E, r, in)
            bt = b.reshape(b.shape[0], r, e_count).permute(2, 1, 0)  # (E, r, out): B^T
            if role == "gate_up":
                self.a_gate_up[slot, :, :r].copy_(a3, non_blocking=True)
                self.a_gate_up[slot, :, big_r : big_r + r].copy_(a3, non_blocking=True)
                self.b_gate_up[slot, :, :r].copy_(bt, non_blocking=True)
            else:
                self.a_down[slot, :, :r].copy_(a3, non_blocking=True)
                self.b_down[slot, :, :r].copy_(bt, non_blocking=True)
            return
        r = a.shape[0]
        self._set_rank(slot, max(self._ranks[slot], r))
        if role == "down":
            self.a_down[slot, expert, :r].copy_(a, non_blocking=True)
            self.b_down[slot, expert, :r].copy_(b.t(), non_blocking=True)
            return
        half = 0 if role == "gate" else 1
        self.a_gate_up[slot, expert, half * big_r : half * big_r + r].copy_(a, non_blocking=True)
        bt = b.t()
        self.b_gate_up[slot, expert, :r, half * i : (half + 1) * i].copy_(bt, non_blocking=True)

    def written(self, slot: int, rank: int) -> None:
        """``slot`` was written (a batched scatter, ``lora/slot_buffers.py``) with experts of
        rank up to ``rank``, after a ``clear``."""
        self._check(slot)
        self.dirty.add(slot)
        self._set_rank(slot, max(self._ranks[slot], rank))


def expert_lora_delta_torch(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    experts: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    out: torch.Tensor,
    *,
    a_div: int,
    top_k: int,
) -> None:
    """The torch twin: the module docstring's loop, one pair of matmuls per (slot, expert)
    group. Host syncs (CPU path, tests)."""
    n_slices = a.shape[2] // b.shape[2]
    big_r = b.shape[2]
    width = out.shape[1] // n_slices
    pair_slots = token_slots.long().repeat_interleave(top_k)  # (P,)
    rank_of = ranks.long().tolist()
    live = ((pair_slots >= 0) & (pair_slots < a.shape[0])).nonzero().squeeze(1)
    if live.numel() == 0:
        return
    keys = pair_slots[live] * a.shape[1] + experts[live].long()
    for key in torch.unique(keys).tolist():
        s, e = divmod(key, a.shape[1])
        r = rank_of[s]
        if r == 0:
            continue
        pairs = live[keys == key]
        rows = x.index_select(0, pairs // a_div).float()
        delta = torch.cat(
            [
                (rows @ a[s, e, j * big_r : j * big_r + r].float().t())
                @ b[s, e, :r, j * width : (j + 1) * width].float()
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
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    out: torch.Tensor,
    *,
    a_div: int,
    top_k: int,
    triton: bool,
    blocks: ExpertBlocks | None = None,
) -> None:
    """``out`` (P, N) += the delta of the module docstring: x (P / a_div, K), a (L, E, S*R, K),
    b (L, E, R, N) (B^T), experts (P,), token_slots (P / top_k,), ranks (L,). ``triton``: the Triton
    kernels over ``blocks`` (the grouped GEMM's sort of ``experts``, made here when None), else
    the twin."""
    p, n = out.shape
    num_slots, e, sr, k = a.shape
    ok_b = b.dim() == 4 and b.shape[:2] == (num_slots, e) and b.shape[3] == n
    if not ok_b or sr % b.shape[2] or x.shape[1] != k:
        raise ValueError(
            f"a {tuple(a.shape)}, b {tuple(b.shape)}, x {tuple(x.shape)}, out {(p, n)}"
        )
    if x.shape[0] * a_div != p or token_slots.shape[0] * top_k != p or experts.shape[0] != p:
        raise ValueError(f"x rows {x.shape[0]} x {a_div}, slots {token_slots.shape[0]} x {top_k}")
    if tuple(ranks.shape) != (num_slots,) or n % (sr // b.shape[2]):
        raise ValueError(f"ranks {tuple(ranks.shape)}, want ({num_slots},); out width {n}")
    if not triton:
        expert_lora_delta_torch(x, a, b, experts, token_slots, ranks, out, a_div=a_div, top_k=top_k)
        return
    from loraplex.engine.model.moe.triton_expert_lora import expert_lora_triton

    if blocks is None:
        blocks = sort_pairs(experts, e, 16, triton=True)
    expert_lora_triton(x, a, b, blocks, token_slots, ranks, out, a_div=a_div, top_k=top_k)
