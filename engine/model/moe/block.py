"""One sparse MLP: the router and the experts of a decoder layer (HF's ``*SparseMoeBlock``).

Weights as transformers 5 holds them in memory (the checkpoint stores them per expert;
``weights.py`` reads both forms)::

    router:    (E, H)        logits = h @ router.T
    w_gate_up: (E, 2I, H)    rows 0 .. I: the expert's gate_proj (Mixtral w1), I .. 2I: up_proj (w3)
    w_down:    (E, H, I)     down_proj (Mixtral w2)

``forward``: routing (``routing.route``, or its one-launch kernel), then the experts' SwiGLU
over the pairs sorted by expert (``grouped_gemm.moe_experts``): the Triton grouped GEMM or its
torch twin. The router is not a LoRA target; the experts are (``expert_lora.ExpertLoRA``:
slots of per-expert A / B, the delta per (token, chosen expert, slot)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.engine.model.moe.expert_lora import ExpertLoRA
from loraplex.engine.model.moe.grouped_gemm import moe_experts
from loraplex.engine.model.moe.pairs import route_pairs
from loraplex.engine.model.moe.spec import MoeSpec

__all__ = ["SparseMoe"]


class SparseMoe(torch.nn.Module):
    def __init__(
        self,
        hidden: int,
        spec: MoeSpec,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        max_loras: int = 0,
        max_rank: int = 16,
        max_expert_loras: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        e, i = spec.num_experts, spec.expert_size
        kw = {"dtype": dtype, "device": device}
        self.router = torch.nn.Parameter(torch.empty(e, hidden, **kw), False)
        self.w_gate_up = torch.nn.Parameter(torch.empty(e, 2 * i, hidden, **kw), False)
        self.w_down = torch.nn.Parameter(torch.empty(e, hidden, i, **kw), False)
        # a list: every forward appends its (T, k) expert ids (the decode benchmark counts the
        # experts a step reads); None (serving): nothing kept
        self.routed: list[torch.Tensor] | None = None
        # expert LoRA storage in LoRA slots 0 .. max_expert_loras - 1 (None: every slot)
        n = max_loras if max_expert_loras is None else min(max_expert_loras, max_loras)
        self.lora: ExpertLoRA | None = None
        if n > 0:
            self.lora = ExpertLoRA(
                e, hidden, i, max_loras=n, max_rank=max_rank, dtype=dtype, device=device
            )

    def forward(
        self, h: torch.Tensor, *, triton: bool, token_slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(T, H) -> (T, H) in the model dtype; ``triton``: the grouped GEMM kernel, else its
        twin; ``token_slots`` (T,): each row's adapter slot (-1: base), None: no LoRA."""
        spec = self.spec
        logits = F.linear(h, self.router)  # (T, E)
        weights, experts = route_pairs(
            logits, spec.top_k, renormalize=spec.renormalize, fp32_weights=spec.fp32_weights,
            triton=triton,
        )  # fmt: skip
        if self.routed is not None:
            self.routed.append(experts)
        return moe_experts(
            h, self.w_gate_up, self.w_down, weights, experts, triton=triton, lora=self.lora,
            token_slots=token_slots,
        )  # fmt: skip

    def expert_bytes(self) -> int:
        """Bytes of one expert's three projections."""
        one = self.w_gate_up[0].numel() + self.w_down[0].numel()
        return one * self.w_gate_up.element_size()
