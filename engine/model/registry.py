"""Model families by HF ``architectures`` name: the model class and its checkpoint weight map.

A config.json names its architecture (``"architectures": ["LlamaForCausalLM"]``); the registry
maps that name to a ``ModelFamily``, imported on first use. Configs that name no registered
architecture (none at all, or an old spelling) fall back to the family registered for their
``model_type``. Anything else is an ``UnknownArchitectureError``.

Adding a family: one model file with a ``FAMILY = ModelFamily(...)`` plus one line in
``_FAMILIES`` (docs/architecture.md, "Adding a model family"). Tests and host apps may
``register`` more at run time. ``loader.build_model`` / ``loader.load_model`` build models.

NOTE: below config.py, which asks ``architecture_for`` first: this module imports no other
module of the model package (families are imported by name).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.engine.model.errors import UnknownArchitectureError

__all__ = [
    "ModelFamily",
    "WeightMap",
    "UnknownArchitectureError",
    "register",
    "unregister",
    "supported",
    "architecture_for",
    "family",
]


class WeightMap(Protocol):
    """Where a checkpoint's tensors go in a model of the family (a ``protocol.CausalLM``)."""

    def target(self, model: torch.nn.Module, name: str) -> torch.Tensor | None:
        """The tensor (or slice of a fused tensor) checkpoint key ``name`` loads into; None:
        a key the model does not use. Raises ``ModelLoadError`` for keys that cannot fit."""
        ...

    def units(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """Every weight the checkpoint must fill, as (name for messages, tensor)."""
        ...


@dataclass(frozen=True)
class ModelFamily:
    # (cfg, *, max_loras, max_lora_rank, dtype, device) -> a protocol.CausalLM, weights empty
    model: Callable[..., torch.nn.Module]
    weights: WeightMap


# HF architectures name: (its config.json model_type, "module:attribute" of its ModelFamily)
_FAMILIES: dict[str, tuple[str, str | ModelFamily]] = {
    "LlamaForCausalLM": ("llama", "loraplex.engine.model.llama:FAMILY"),
    "MistralForCausalLM": ("mistral", "loraplex.engine.model.llama:FAMILY"),
    "Qwen2ForCausalLM": ("qwen2", "loraplex.engine.model.llama:FAMILY"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "loraplex.engine.model.moe.weights:FAMILY"),
    "MixtralForCausalLM": ("mixtral", "loraplex.engine.model.moe.weights:FAMILY"),
}


def register(architecture: str, model_type: str, family: ModelFamily | str) -> None:
    """Serve configs naming ``architecture`` (or, failing that, ``model_type``) with
    ``family``: the object or its ``"module:attribute"``, imported on first use."""
    _FAMILIES[architecture] = (model_type, family)


def unregister(architecture: str) -> None:
    _FAMILIES.pop(architecture, None)


def supported() -> list[str]:
    return sorted(_FAMILIES)


def architecture_for(architectures: Sequence[str], model_type: str | None) -> str:
    """The registered architecture serving a config.json with these fields."""
    for name in architectures:
        if name in _FAMILIES:
            return name
    for name, (mtype, _) in _FAMILIES.items():
        if mtype == model_type:
            return name
    named = f"architectures {list(architectures)}, " if architectures else ""
    raise UnknownArchitectureError(
        f"{named}model_type {model_type!r} is not supported "
        f"(supported architectures: {', '.join(supported())})"
    )


def family(architecture: str) -> ModelFamily:
    if architecture not in _FAMILIES:
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported "
            f"(supported architectures: {', '.join(supported())})"
        )
    model_type, fam = _FAMILIES[architecture]
    if isinstance(fam, str):
        module, _, attr = fam.partition(":")
        fam = getattr(importlib.import_module(module), attr)
        assert isinstance(fam, ModelFamily), f"{module}:{attr} is not a ModelFamily"
        _FAMILIES[architecture] = (model_type, fam)
    return fam
