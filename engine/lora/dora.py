"""DoRA (PEFT ``use_dora``): weight-decomposed LoRA as a per-row scale of the projection.

PEFT computes, per targeted module with base W (out, in), LoRA scale s, magnitude m (out,):

    y = g * (x W^T + s (x A^T) B^T) + bias,     g = m / ||W + s B A||_row   (out,)

(the norm over each output row, i.e. over ``in``). g depends on the base weights and the
adapter only, so it is computed once per adapter load against the model's own W
(``compute_dora``, off the step path: a worker thread, on CUDA its own stream), and kept twice:

- folded into B (B <- g * B, rows), like the LoRA scale: every delta kernel is unchanged;
- as ``LoRALinear.dora_scale[slot]`` (out,) for the base part, ``ops.dora.apply_dora`` on the base
  output of the rows whose slot holds a DoRA adapter (y <- g * (y - bias) + bias) before the
  delta is added. Steps without such rows never run it (``LoRAMapping.dora`` is False).

Row ``L`` (= index -1) of ``dora_scale`` stays 1: base rows (slot -1) index it unchanged.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from loraplex.engine.lora.adapter import check_weight_values

if TYPE_CHECKING:
    from loraplex.engine.lora.adapter import LoRAAdapter
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["compute_dora"]


@torch.no_grad()
def compute_dora(
    model: CausalLM, adapter: LoRAAdapter, magnitudes: dict[tuple[int, str], torch.Tensor]
) -> None:
    """Set ``adapter.dora`` to g per module (float32, CPU) and fold g into its B in place
    (the packed image's B blocks are the same storage). Blocking (a worker thread).
    A tensor-parallel shard is refused (g needs each row's whole norm: not split yet)."""
    if getattr(model, "tp", None) is not None:
        from loraplex.engine.model.tp import TensorParallelError

        raise TensorParallelError(f"adapter {adapter.name!r}: DoRA is not split over ranks yet")
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
            lw = adapter.weights[key]
            delta = lw.b.to(device, torch.float32) @ lw.a.to(device, torch.float32)
            g = m.to(device) / torch.linalg.norm(w + delta, dim=1)
            out[key] = g.cpu()
    if stream is not None:
        stream.synchronize()
    for key, g in out.items():
        # NOTE: trained magnitudes keep g near 1; NaN / Inf / huge g come from broken files
        check_weight_values(g, f"layer {key[0]} {key[1]} DoRA scale m / ||W + s B A||")
        b = adapter.weights[key].b  # (out, r): a view of the packed image, or the tensor
        scaled = b.float() * g[:, None]
        check_weight_values(scaled, f"layer {key[0]} {key[1]} lora_B (DoRA scale folded in)")
        b.copy_(scaled)
    adapter.dora = out
