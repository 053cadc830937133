"""The grouped expert GEMM: every (token, chosen expert) pair times its expert's weight.

Semantics (``grouped_gemm_torch`` is this loop, grouped by expert)::

    for p in range(P):                       # P = T * k pairs, pair p = token * k + j
        e = experts[p]                       # the pair's expert
        y = round(a[p // a_div] @ w[e].T)    # a: (rows, K); w: (E, N, K); fp32 accumulation
        out[p] = round(y * scale[p]) if scale is not None else y     # out: (P, N)

``a_div``: k when ``a`` holds one row per token (the gate_up GEMM reads the token's hidden
state for each of its k pairs), 1 when it holds one row per pair (the down GEMM).
``scale``: the pair's routing weight (float32 or the model dtype, moe/routing.py), applied as
HF does, to the rounded projection. ``round`` = cast to ``out``'s dtype.

The Triton kernel (``triton_grouped.py``) reads the pairs sorted by expert in blocks of one
expert each (``routing.ExpertBlocks``) and loads each weight tile once per block: a decode step
reads each expert that some token chose once per ``block_m`` of its pairs, not once per token.
Its launch depends on P, E, N and K only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.engine.model.moe.expert_lora import ExpertLoRA, expert_lora_delta
from loraplex.engine.model.moe.pairs import sort_pairs
from loraplex.engine.model.moe.routing import ExpertBlocks

__all__ = ["grouped_gemm", "grouped_gemm_torch", "moe_experts", "block_m_for"]


def grouped_gemm_torch(
    a: torch.Tensor,
    w: torch.Tensor,
    experts: torch.Tensor,
    out: torch.Tensor,
    *,
    a_div: int,
    scale: torch.Tensor | None = None,
) -> None:
    """The torch twin: the module docstring's loop, one matmul per expert over its pairs.
    ``experts``: (P,) the expert of each pair. Host syncs (the CPU path and the tests)."""
    for e in torch.unique(experts).tolist():
        pairs = (experts == e).nonzero().squeeze(1)
        y = (a.index_select(0, pairs // a_div) @ w[e].t()).to(out.dtype)
        if scale is not None:
            y = (y.float() * scale.index_select(0, pairs).float()[:, None]).to(out.dtype)
        out.index_copy_(0, pairs, y)


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block of the sorted pairs: 16 (the smallest tensor-core tile) while experts get
    a few pairs each (decode), 64 once they get many (prefill)."""
    return 64 if num_pairs >= 64 * num_experts else 16


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    experts: torch.Tensor,
    out: torch.Tensor,
    *,
    a_div: int,
    scale: torch.Tensor | None = None,
    blocks: ExpertBlocks | None = None,
    triton: bool,
) -> None:
    """``out`` (P, N) = the module docstring's loop; ``triton``: the kernel (its pairs sorted
    by ``blocks``, made here when None), else the twin."""
    p, n = out.shape
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2] or w.shape[1] != n:
        raise ValueError(f"a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if tuple(experts.shape) != (p,) or a.shape[0] * a_div != p:
        raise ValueError(f"experts {tuple(experts.shape)}, a rows {a.shape[0]} x {a_div} != {p}")
    if scale is not None and tuple(scale.shape) != (p,):
        raise ValueError(f"scale {tuple(scale.shape)}, want ({p},)")
    if not triton:
        grouped_gemm_torch(a, w, experts, out, a_div=a_div, scale=scale)
        return
    from loraplex.engine.model.moe.triton_grouped import grouped_gemm_triton

    if blocks is None:
        blocks = sort_pairs(experts, w.shape[0], block_m_for(p, w.shape[0]), triton=True)
    grouped_gemm_triton(a, w, blocks, out, a_div=a_div, scale=scale)


def moe_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    *,
    triton: bool,
    lora: ExpertLoRA | None = None,
    token_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' SwiGLU MLP of every token, summed over its k choices::

        for t, j:  e = experts[t, j]
            g, u = split(round(x[t] @ w_gate_up[e].T))          # (E, 2I, H): gate rows, up rows
            y[t, j] = round(round(round(silu(g)) * u) @ w_down[e].T) * weights[t, j]
        out[t] = round(sum_j float32(round(y[t, j])))           # (T, H)

    x: (T, H); weights, experts: (T, k) (``routing.route``). HF adds the k terms into the
    output one expert at a time in the model dtype (``index_add_``); here they are summed in
    float32 and rounded once (the same in float32 up to the order of the sum).

    ``lora`` / ``token_slots`` (T,): each pair's expert LoRA delta (moe/expert_lora.py) is
    added to its gate_up projection before SiLU * up and to its down projection before the
    routing weight (a pair of a base row, slot -1, gets none)."""
    t, k = experts.shape
    p = t * k
    inter = w_down.shape[2]
    flat = experts.reshape(-1)
    blocks = None
    if triton:  # one sort serves both GEMMs
        e = w_gate_up.shape[0]
        blocks = sort_pairs(flat, e, block_m_for(p, e), triton=True)
    gu = torch.empty(p, 2 * inter, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w_gate_up, flat, gu, a_div=k, blocks=blocks, triton=triton)
    if lora is not None and token_slots is not None:
        expert_lora_delta(
            x, lora.a_gate_up, lora.b_gate_up, flat, token_slots, lora.ranks, gu, a_div=k,
            top_k=k, triton=triton, blocks=blocks,
        )  # fmt: skip
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch.empty(p, w_down.shape[1], dtype=x.dtype, device=x.device)
    scale = weights.reshape(-1)
    if lora is None or token_slots is None:
        grouped_gemm(act, w_down, flat, y, a_div=1, scale=scale, blocks=blocks, triton=triton)
    else:  # the delta goes in before the routing weight
        grouped_gemm(act, w_down, flat, y, a_div=1, blocks=blocks, triton=triton)
        expert_lora_delta(
            act, lora.a_down, lora.b_down, flat, token_slots, lora.ranks, y, a_div=1, top_k=k,
            triton=triton, blocks=blocks,
        )  # fmt: skip
        y = (y.float() * scale.float()[:, None]).to(y.dtype)
    return y.view(t, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
