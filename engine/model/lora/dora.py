"""DoRA (PEFT ``use_dora``): weight-decomposed LoRA as a per-row scale of the projection.

PEFT computes, per targeted module with base W (out, in), LoRA scale s, magnitude m (out,):

    y = g * (x W^T + s (x A^T) B^T) + bias,     g = m / ||W + s B A||_row   (out,)

(the norm over each output row, i.e. over ``in``). g depends on the base weights and the
adapter only, so it is computed once per adapter load against the model's own W
(``row_scales``, off the step path: a worker thread, on CUDA its own stream; the adapter
lifecycle checks it and folds it, adapters/checks.py ``fold_dora``), and kept twice:

- folded into B (B <- g * B, rows), like the LoRA scale: every delta kernel is unchanged;
- as ``LoRALinear.dora_scale[slot]`` (out,) for the base part, ``ops.dora.apply_dora`` on the base
  output of the rows whose slot holds a DoRA adapter (y <- g * (y - bias) + bias) before the
  delta is added. Steps without such rows never run it (``LoRAMapping.dora`` is False).

Row ``L`` (= index -1) of ``dora_scale`` stays 1: base rows (slot -1) index it unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.engine.model.lora.weights import LoRAWeights
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["row_scales"]


@torch.no_grad()
def row_scales(
    model: CausalLM,
    name: str,
    weights: Mapping[tuple[int, str], LoRAWeights],
    magnitudes: Mapping[tuple[int, str], torch.Tensor],
) -> dict[tuple[int, str], torch.Tensor]:
    """g = m / ||W + s B A|| per module of ``magnitudes`` (float32, CPU), against ``model``'s
    base weights (``weights``: B with the LoRA scale folded in, not g yet). Blocking (a worker
    thread). A tensor-parallel shard is refused (g needs each row's whole norm: not split
    yet); ``name``: the adapter's, for that message."""
    if getattr(model, "tp", None) is not None:
        from loraplex.engine.model.tp import TensorParallelError

        raise TensorParallelError(f"adapter {name!r}: DoRA is not split over ranks yet")
    linears = dict(model.lora_linears())
    device = model.device
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    out: dict[tuple[int, str], torch.Tensor] = {}
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for key, m in magnitudes.items():
            layer, module = key
            lin = linears[layer][module]
            s = lin.slice_index(module)
            w = lin.weight[lin.slice_offsets[s] : lin.slice_offsets[s + 1]].float()  # (out, in)
            lw = weights[key]
            delta = lw.b.to(device, torch.float32) @ lw.a.to(device, torch.float32)
            g = m.to(device) / torch.linalg.norm(w + delta, dim=1)
            out[key] = g.cpu()
    if stream is not None:
        stream.synchronize()
    return out
