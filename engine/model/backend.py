"""Kernel backends: which forward and which LoRA kernels a model runner uses.

One selector, ``EngineConfig.kernel_backend`` (``loraplex serve --kernel-backend``), picked
once per runner:

| name    | forward                                             | LoRA kernels                 |
|---------|-----------------------------------------------------|------------------------------|
| `fused` | ``fused.py``: augmented GEMMs, fused epilogues,     | Triton epilogues             |
|         | Triton paged attention; CUDA graphs on the GPU      |                              |
| `sgmv`  | ``llama.py`` reference forward, torch attention     | Triton SGMV shrink / expand  |
| `torch` | ``llama.py`` reference forward, torch attention     | torch twins (``model/lora/ops``)   |
| `auto`  | `fused` on CUDA, `torch` elsewhere                  |                              |

Triton on CPU runs only under ``TRITON_INTERPRET=1`` (the tests). A ``KernelBackend`` is the
pair of switches behind a name; tests may build one directly (the fused forward with the
epilogues' torch twins: ``KernelBackend(fused=True, triton=False)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["KERNEL_BACKENDS", "KernelBackend", "resolve_kernel_backend", "triton_reaches"]

KERNEL_BACKENDS = ("auto", "fused", "sgmv", "torch")


@dataclass(frozen=True)
class KernelBackend:
    fused: bool  # the GPU forward (fused.py), else the reference forward (llama.py)
    triton: bool  # LoRA kernels as Triton, else their torch twins


_NAMED = {
    "fused": KernelBackend(fused=True, triton=True),
    "sgmv": KernelBackend(fused=False, triton=True),
    "torch": KernelBackend(fused=False, triton=False),
}


def resolve_kernel_backend(
    backend: str | KernelBackend, device: torch.device | str
) -> KernelBackend:
    """The switches behind ``backend`` on ``device`` (``auto``: fused on CUDA, torch elsewhere).
    A Triton backend on a device other than CUDA needs the interpreter (``TRITON_INTERPRET=1``),
    else it is refused."""
    if isinstance(backend, KernelBackend):
        return backend
    if backend == "auto":
        backend = "fused" if torch.device(device).type == "cuda" else "torch"
    if backend not in _NAMED:
        raise ValueError(f"kernel backend {backend!r} is not one of {', '.join(KERNEL_BACKENDS)}")
    picked = _NAMED[backend]
    if picked.triton and torch.device(device).type != "cuda" and not _interpreted():
        # (refused here, at start-up: the first Triton launch on CPU tensors would fail a step)
        raise ValueError(
            f"kernel backend {backend!r} runs Triton kernels, which reach {device} tensors only "
            f"under TRITON_INTERPRET=1 (the tests); use 'auto' or 'torch' on {device}"
        )
    return picked


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_reaches(t: torch.Tensor) -> bool:
    """Whether a Triton launch can read ``t``: CUDA tensors, or any under the interpreter
    (``TRITON_INTERPRET=1``: CPU tensors in the tests). Elsewhere the caller runs its twin."""
    return t.is_cuda or _interpreted()
