"""An adapter's weights as the model side reads them, and what a slot write takes.

``LoRAWeights`` is one module's pair (A (r, in), B (out, r) with the LoRA scale folded in);
``WeightsView`` a read-only mapping whose tensors are made on access (views of a packed slot
image, slot_image.PackedWeights). ``SlotSource`` is what the device half of a slot write
(slot_buffers.py) and tensor parallelism's sharding (model/tp.py) read of an adapter: the
lifecycle's parsed adapter (``LoRAAdapter``) is one; the model side never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["LoRAWeights", "WeightsView", "HasWeights", "SlotSource"]


@dataclass(frozen=True)
class LoRAWeights:
    a: torch.Tensor  # (r, in); a fused experts module (model/moe/lora_names.py): (r * E, in)
    b: torch.Tensor  # (out, r), LoRA scale already folded in; fused experts: (out, r * E)
    experts: int = 1  # E of a fused experts module (its per-expert rank is r), else 1


class WeightsView(Mapping[tuple[int, str], LoRAWeights]):
    """Read-only weights whose tensors are made on access (e.g. views of a packed slot image,
    slot_image.PackedWeights); knows its rank and byte size without making them."""

    rank: int
    nbytes: int


class HasWeights(Protocol):
    """Anything with per-module weights: (layer index, module short name) -> pair."""

    @property
    def weights(self) -> Mapping[tuple[int, str], LoRAWeights]: ...


class SlotSource(HasWeights, Protocol):
    """What a slot write reads of an adapter: its name (messages), per-module weights, DoRA's
    row scales per module (None: plain LoRA), its full tables (modules_to_save; empty for
    most adapters) and its slot image if it has one."""

    @property
    def name(self) -> str: ...

    @property
    def dora(self) -> Mapping[tuple[int, str], torch.Tensor] | None: ...

    @property
    def full(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def image(self) -> Any:
        """Its slot image (a ``slot_image.PackedAdapter``, made when it was staged; not
        imported here: slot_image.py imports this module); None: packed per write."""
        ...
