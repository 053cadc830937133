"""Per-request composition: several adapters with weights as one adapter of the summed rank.

The result equals PEFT's ``add_weighted_adapter(adapters, weights, combination_type="cat")``
(for components without ``use_rslora`` in the first one, whose quirk rescales the sum by
``sqrt(r1 + r2 + ...)``): per module the A blocks are stacked and the B blocks (their LoRA
scale already folded in) multiplied by their weight and placed side by side, so

    delta(x) = sum_i w_i * (x A_i^T) (s_i B_i)^T = (x [A_1; A_2]^T) [w_1 s_1 B_1 | w_2 s_2 B_2]^T

A module that only some components target gets only their blocks (no zero padding).

Expert modules (model/moe/lora_names.py) combine the same way, expert by expert: a per-expert
module is a plain pair; a fused one (A (r*E, in) with expert e's rows e*r .., B (out, r*E) with
its column j at j*E + e) gets each expert's blocks stacked within its own rows and columns, so
the result is again PEFT's fused layout at rank r1 + r2. Components that name one layer's
experts in the two layouts are refused (a slot holds one layout a layer).
"""

from __future__ import annotations

import torch

from loraplex.engine.adapters.parse import LoRAAdapter, check_weight_values
from loraplex.engine.errors import AdapterConfigError, AdapterRankError
from loraplex.engine.model.config import MODULE_ORDER
from loraplex.engine.model.lora.weights import LoRAWeights
from loraplex.engine.model.moe.lora_names import expert_module

__all__ = ["combine_adapters"]


@torch.no_grad()
def combine_adapters(
    parts: list[tuple[LoRAAdapter, float]],
    *,
    name: str,
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """One adapter whose delta is the weighted sum of ``parts``' deltas (see the module).

    ``parts``' tensors are read as they are (load them in float32 for an exact sum); the
    result is in ``dtype``. Raises AdapterRankError if a module's summed rank is above
    ``max_lora_rank``, AdapterValueError if a weighted B leaves the accepted range."""
    for a, _ in parts:
        if a.config.use_dora:
            raise AdapterConfigError(
                f"adapter {a.name!r} is a DoRA adapter: DoRA adapters cannot be composed",
                field="adapters",
            )
        if a.full or a.config.modules_to_save:
            raise AdapterConfigError(
                f"adapter {a.name!r} replaces full embed_tokens / lm_head tables "
                "(modules_to_save): such adapters cannot be composed",
                field="adapters",
            )
    keys = sorted(
        {k for a, _ in parts for k in a.weights},
        key=lambda k: (k[0], MODULE_ORDER[k[1]]),
    )
    _check_expert_layouts(keys, name)
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for key in keys:
        blocks = [(a.weights[key], w) for a, w in parts if key in a.weights]
        rank = sum(lw.a.shape[0] // lw.experts for lw, _ in blocks)
        if rank > max_lora_rank:
            raise AdapterRankError(
                f"the combination {name!r} has rank {rank} at layer {key[0]} {key[1]}, above "
                f"max_lora_rank {max_lora_rank}",
                field="adapters",
            )
        n_exp = blocks[0][0].experts
        if any(lw.experts != n_exp for lw, _ in blocks):
            raise AdapterConfigError(
                f"the combination {name!r} has components with other expert counts at layer "
                f"{key[0]} {key[1]}",
                field="adapters",
            )
        # fused experts: (E, r_i, in) and (out, r_i, E) blocks, stacked along r per expert
        a = torch.cat(
            [lw.a.float().view(n_exp, -1, lw.a.shape[1]) for lw, _ in blocks], dim=1
        ).reshape(-1, blocks[0][0].a.shape[1])  # (E * (r1 + r2), in); (r1 + r2, in) if E = 1
        b = torch.cat(
            [(lw.b.float() * w).view(lw.b.shape[0], -1, n_exp) for lw, w in blocks], dim=1
        ).reshape(blocks[0][0].b.shape[0], -1)  # (out, (r1 + r2) * E)
        check_weight_values(b, f"{name}: layer {key[0]} {key[1]} lora_B (weighted)")
        weights[key] = LoRAWeights(
            a=a.to(dtype).contiguous(), b=b.to(dtype).contiguous(), experts=n_exp
        )
    return LoRAAdapter(name=name, path="", config=parts[0][0].config, weights=weights)


def _check_expert_layouts(keys: list[tuple[int, str]], name: str) -> None:
    """One expert layout a layer: the fused and the per-expert form together are refused."""
    fused, per = set(), set()
    for layer, module in keys:
        em = expert_module(module)
        if em is not None:
            (fused if em.expert is None else per).add(layer)
    both = sorted(fused & per)
    if both:
        raise AdapterConfigError(
            f"the combination {name!r} mixes PEFT's fused expert form (target_parameters) and "
            f"the per-expert form at layer {both[0]}: compose adapters of one expert layout",
            field="adapters",
        )
