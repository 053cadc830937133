"""The experts' LoRA modules as adapters name them, and their shapes.

Two layouts reach us (docs/architecture.md, "Mixture of experts"):

- PEFT's ``target_parameters`` form on transformers 5's fused experts, one module per layer and
  parameter: ``experts.gate_up_proj`` (in H, out 2I: gate rows, then up rows) and
  ``experts.down_proj`` (in I, out H). Its A is (r*E, in) with expert e's rank-r block at rows
  e*r .. (e+1)*r; its B is (out, r*E) with expert e's column j at j*E + e (PEFT's
  ``ParamWrapper`` reshapes B to (out, r, E)). The image keeps both as the file has them (a
  "module" of ``experts`` = E); the slot write splits them per expert.
- The per-expert ``target_modules`` form of older adapters (transformers 4 held experts as
  modules): ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's
  ``experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down); one rank-r pair each.

Module names keep the adapter's own spelling (``w1`` stays ``w1``) so that its config's
patterns (targets, ``rank_pattern``, ``alpha_pattern``) match what it was trained with.

NOTE: imports nothing of the engine (``model/config.py`` imports it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "FUSED_PARAMS",
    "ExpertModule",
    "expert_module",
    "expert_parent",
    "expert_module_order",
    "per_expert_name",
    "PROJ_ROLE",
]

# the fused experts' parameters in the model's parameter order (PEFT nests its wrappers in this
# order: the first one targeted is the innermost, ``experts.base_layer...``)
FUSED_PARAMS = ("gate_up_proj", "down_proj")
# a per-expert projection's role: "gate" / "up" (halves of gate_up) or "down"
PROJ_ROLE = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
_ROLE_ORDER = {"gate": 0, "up": 1, "down": 2}
_PER_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)$")
_FUSED = re.compile(r"^experts\.(gate_up_proj|down_proj)$")
_ORDER_BASE = 100  # after every dense and vocab module (model/config.py MODULE_ORDER)


@dataclass(frozen=True)
class ExpertModule:
    """What an expert module name means: ``expert`` None for a fused-form module (every
    expert), else the one expert; ``role``: gate_up (fused), gate, up or down."""

    expert: int | None
    role: str

    @property
    def fused(self) -> bool:
        return self.expert is None

    def shape(self, hidden: int, width: int) -> tuple[int, int]:
        """(in, out) of the module's per-expert projection for hidden H and expert width I."""
        if self.role == "gate_up":
            return hidden, 2 * width
        if self.role == "down":
            return width, hidden
        return hidden, width


def expert_module(module: str) -> ExpertModule | None:
    """The meaning of an expert module name, None for any other name."""
    m = _FUSED.match(module)
    if m is not None:
        return ExpertModule(None, "gate_up" if m.group(1) == "gate_up_proj" else "down")
    m = _PER_EXPERT.match(module)
    if m is not None and m.group(2) in PROJ_ROLE:
        return ExpertModule(int(m.group(1)), PROJ_ROLE[m.group(2)])
    return None


def expert_parent(module: str) -> str:
    """The parent of an expert module in PEFT's names: Mixtral's per-expert ``w1 / w2 / w3``
    live under ``block_sparse_moe`` (its transformers 4 modules), everything else under
    ``mlp`` (transformers 5 names Mixtral's fused experts ``mlp.experts`` too)."""
    return "block_sparse_moe" if module.rsplit(".", 1)[-1] in ("w1", "w2", "w3") else "mlp"


def expert_module_order(module: str) -> int:
    """Sort key of an expert module after the dense ones: fused modules, then expert by
    expert gate, up, down."""
    em = expert_module(module)
    if em is None:
        raise KeyError(module)
    if em.fused:
        return _ORDER_BASE + (0 if em.role == "gate_up" else 1)
    return _ORDER_BASE + 2 + 3 * em.expert + _ROLE_ORDER[em.role]  # type: ignore[operator]


def per_expert_name(expert: int, role: str, mixtral: bool) -> str:
    """The per-expert module name of ``role`` in the family's spelling."""
    names = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
    return f"experts.{expert}.{names[role][1 if mixtral else 0]}"
