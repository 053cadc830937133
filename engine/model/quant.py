"""fp8 (float8 e4m3) base weights: quantize, de-quantize, and the published fp8 checkpoint forms.

Only the base projections are fp8: q/k/v/o and gate/up/down, the rows of each ``LoRALinear``'s
base weight. Embeddings, norms and the LM head stay in the compute dtype (a checkpoint that
stores one of them in fp8 is de-quantized on load and kept in the compute dtype only). LoRA
adapters are never quantized.

Where fp8 weights come from (``loader.load_model``):

- ``quantization="fp8"`` on a bf16 / fp16 / fp32 checkpoint: each projection weight is
  quantized on load with one scale per output channel (``quantize_fp8``).
- A pre-quantized checkpoint, read as published (no re-quantization), found from config.json's
  ``quantization_config`` (``parse_quantization_config``, before any tensor is read):
  - ``quant_method: "fp8"`` (vLLM / transformers): ``X.weight`` in F8_E4M3 with one float32
    scale per tensor (``X.weight_scale``, shape () or (1,)), or, with
    ``weight_block_size: [bn, bk]``, one per (bn, bk) block (``X.weight_scale_inv``, shape
    (ceil(out / bn), ceil(in / bk))). Either key name is accepted for either layout.
  - ``quant_method: "compressed-tensors"`` (llm-compressor), ``format`` ``float-quantized`` or
    ``naive-quantized``, every config group's ``weights`` 8-bit ``float``, symmetric, strategy
    ``tensor`` (``X.weight_scale`` (1,)), ``channel`` (out, 1), ``group`` (out, in / group_size)
    or ``block`` (ceil(out / bn), ceil(in / bk)).
  Scales multiply: weight = fp8 value * scale. Activation quantization in the config (static
  ``input_scale`` tensors, dynamic per-token) and a ``kv_cache_scheme`` are not applied: the
  de-quantized weights see activations and KV in the compute dtype. Any other
  ``quantization_config`` is an ``UnsupportedQuantizationError`` naming the format.

How the weights live in the model: the fp8 form is kept as buffers of each ``LoRALinear``
whose base rows are all fp8 (``fp8_weight(lin)``, ``fp8_layers(model)``). On CPU the
projections run on weights de-quantized to the compute dtype (``weight_aug``, the slow path
for tests). On CUDA the float base rows are freed after loading (``drop_float_bases``: the
base weights take half the memory of bf16) and the projections run the fp8 GEMM
(``kernels/fp8_linear.py``; the fused forward and ``LoRALinear.forward``):

    weight_fp8:   (N_total, in) torch.float8_e4m3fn, rows in the layer's fused order (q, k, v)
    weight_scale: (N_total, G) float32, G divides in; group = in // G:
                  weight[n, k] = weight_fp8[n, k] * weight_scale[n, k // group]

G = 1 (per output channel) for on-load quantization, ``channel`` scales, and per-tensor scales
(one value repeated over the rows of its slice: q, k and v keep their own); block scales are
repeated over the bn rows of their block (G = in / bk; in must be a multiple of bk).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from loraplex.engine.model.errors import UnsupportedQuantizationError

if TYPE_CHECKING:
    from loraplex.engine.model.lora.layers import LoRALinear

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Format",
    "Fp8Rows",
    "quantize_fp8",
    "dequantize_fp8",
    "row_scales",
    "parse_quantization_config",
    "fp8_weight",
    "fp8_layers",
    "quantize_model",
    "drop_float_bases",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_SERVED = "fp8, compressed-tensors with 8-bit float weights"
_CT_FORMATS = ("float-quantized", "naive-quantized")
_STRATEGIES = ("tensor", "channel", "group", "block")


@torch.no_grad()
def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, in) -> fp8 values (N, in) and one float32 scale per output channel (N,):
    ``w ≈ q.float() * scale[:, None]``, scale = amax(|row|) / 448 (a zero row: scale 0, q 0)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    inv = 1.0 / scale.clamp(min=torch.finfo(torch.float32).tiny)
    q = (w * inv[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 (N, in) and row scales (N, G) (``row_scales``) -> the weight (N, in) in ``dtype``."""
    n, k = q.shape
    g = scale.shape[1]
    w = q.float().view(n, g, k // g) * scale.float()[:, :, None]
    return w.view(n, k).to(dtype)


@dataclass(frozen=True)
class Fp8Format:
    """How a pre-quantized checkpoint stores fp8 weights (from config.json)."""

    method: str  # "fp8" | "compressed-tensors"
    strategies: tuple[str, ...]  # scale layouts its tensors may use (see the module docstring)
    scale_keys: tuple[str, ...]  # the scale of "X.weight" is "X.<first of these found>"
    block: tuple[int, int] | None = None  # (rows, cols) per scale, strategy "block"
    group_size: int | None = None  # columns per scale, strategy "group"


def row_scales(scale: torch.Tensor, rows: int, cols: int, fmt: Fp8Format) -> torch.Tensor:
    """A stored scale tensor -> (rows, G) float32 row scales of a (rows, cols) weight.
    Raises ValueError when its shape fits none of the format's layouts."""
    s = scale.float()
    shape = tuple(s.shape)
    if "tensor" in fmt.strategies and s.numel() == 1:
        return s.reshape(1, 1).expand(rows, 1).contiguous()
    if "channel" in fmt.strategies and shape in ((rows,), (rows, 1)):
        return s.reshape(rows, 1).contiguous()
    gs = fmt.group_size
    if "group" in fmt.strategies and gs and cols % gs == 0 and shape == (rows, cols // gs):
        return s.contiguous()
    if "block" in fmt.strategies and fmt.block is not None:
        bn, bk = fmt.block
        if shape == (-(-rows // bn), -(-cols // bk)):
            if cols % bk:
                raise ValueError(
                    f"block scales need in_features ({cols}) to be a multiple of the block "
                    f"width {bk}"
                )
            return s.repeat_interleave(bn, dim=0)[:rows].contiguous()
    raise ValueError(
        f"scale of shape {list(shape)} fits no {'/'.join(fmt.strategies)} layout of a "
        f"{rows}x{cols} weight"
    )


def parse_quantization_config(qc: Any) -> Fp8Format | None:
    """config.json's ``quantization_config`` -> the fp8 format, or None (no such field).
    Any other quantization is an ``UnsupportedQuantizationError`` naming it."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedQuantizationError("config.json: quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_method(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    named = f"quant_method {method!r}" if method else "a quantization_config without quant_method"
    raise UnsupportedQuantizationError(
        f"config.json: {named} is not supported (served quantized checkpoints: {_SERVED})"
    )


def _refuse(what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"config.json: {what} is not supported ({_SERVED})")


def _pair(value: Any, what: str) -> tuple[int, int]:
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise _refuse(f"{what} {value!r} (two positive integers expected)")
    return int(value[0]), int(value[1])


def _fp8_method(qc: dict) -> Fp8Format:
    fmt = qc.get("fmt", "e4m3")  # transformers' FineGrainedFP8Config writes it
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise _refuse(f"quant_method 'fp8' with fmt {fmt!r}")
    keys = ("weight_scale_inv", "weight_scale")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Format("fp8", ("tensor",), keys)
    return Fp8Format("fp8", ("block",), keys, block=_pair(block, "weight_block_size"))


def _compressed_tensors(qc: dict) -> Fp8Format:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _refuse(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    if qc.get("transform_config"):
        raise _refuse("compressed-tensors with a transform_config (rotated weights)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors without config_groups")
    strategies: list[str] = []
    blocks, group_sizes = set(), set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"compressed-tensors config group {name!r} of {group!r}")
        fmt = group.get("format") or qc.get("format")
        if fmt not in _CT_FORMATS:
            raise _refuse(f"compressed-tensors format {fmt!r} (config group {name!r})")
        w = group.get("weights")
        if not w:
            continue  # activations only: weights stay in the checkpoint's float dtype
        if not isinstance(w, dict):
            raise _refuse(f"compressed-tensors weights {w!r} (config group {name!r})")
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
        if bits != 8 or kind != "float":
            raise _refuse(f"compressed-tensors {bits}-bit {kind} weights (config group {name!r})")
        if strategy not in _STRATEGIES:
            raise _refuse(f"compressed-tensors weight strategy {strategy!r} (group {name!r})")
        if w.get("symmetric") is False or w.get("dynamic"):
            raise _refuse(f"compressed-tensors asymmetric or dynamic weights (group {name!r})")
        if strategy == "block":
            blocks.add(_pair(w.get("block_structure"), "block_structure"))
        if strategy == "group":
            size = w.get("group_size")
            if not isinstance(size, int) or size <= 0:
                raise _refuse(f"compressed-tensors group_size {size!r} (group {name!r})")
            group_sizes.add(size)
        strategies.append(strategy)
    if len(blocks) > 1 or len(group_sizes) > 1:
        raise _refuse("compressed-tensors with several block structures or group sizes")
    return Fp8Format(
        "compressed-tensors",
        tuple(sorted(set(strategies), key=_STRATEGIES.index)),
        ("weight_scale",),
        block=next(iter(blocks), None),
        group_size=next(iter(group_sizes), None),
    )


class Fp8Rows:
    """The fp8 rows of a model's base projections as the loader reads them; ``attach`` stores
    them on their layers (``weight_fp8``, ``weight_scale``) once the checkpoint is read."""

    def __init__(self, layers: Iterable[LoRALinear]) -> None:
        self._layers = list(dict.fromkeys(layers))  # unique, in model order
        self._rows: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def owner(self, dst: torch.Tensor) -> tuple[LoRALinear, int] | None:
        """The layer whose base weight rows ``dst`` views, and its first row; None: ``dst`` is
        no projection weight (embeddings, norms, LM head, biases)."""
        ptr = dst.data_ptr()
        for lin in self._layers:
            assert not lin.base_transposed, "fp8 rows are read before the CPU layout change"
            row_bytes = lin.in_features * lin.weight_aug.element_size()
            offset = ptr - lin.weight_aug.data_ptr()
            if 0 <= offset < lin.out_features * row_bytes:
                if dst.dim() != 2 or dst.shape[1] != lin.in_features or offset % row_bytes:
                    return None
                return lin, offset // row_bytes
        return None

    def add(self, lin: LoRALinear, row: int, q: torch.Tensor, scale: torch.Tensor) -> None:
        self._rows.setdefault(id(lin), []).append((row, q, scale))

    def attach(self, device: torch.device | str) -> int:
        """Register the buffers on every layer whose rows are all fp8; returns their count.
        Raises ValueError for a layer only some of whose slices are fp8."""
        count = 0
        for lin in self._layers:
            rows = sorted(self._rows.pop(id(lin), []), key=lambda r: r[0])
            if not rows:
                continue
            covered = sum(q.shape[0] for _, q, _ in rows)
            widths = {s.shape[1] for _, _, s in rows}
            if covered != lin.out_features or len(widths) > 1:
                names = "/".join(lin.slice_names)
                raise ValueError(
                    f"some but not all of {names} are fp8 (or their scales differ in layout): "
                    "a fused projection is served fp8 as a whole or not at all"
                )
            lin.register_buffer("weight_fp8", torch.cat([q for _, q, _ in rows]).to(device))
            lin.register_buffer("weight_scale", torch.cat([s for _, _, s in rows]).to(device))
            count += 1
        return count


def fp8_weight(lin: LoRALinear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight_fp8 (N_total, in), weight_scale (N_total, G)) of a layer loaded fp8, else None."""
    q = getattr(lin, "weight_fp8", None)
    return None if q is None else (q, lin.weight_scale)


def fp8_layers(model: Any) -> list[LoRALinear]:
    """The model's projections (a ``CausalLM``'s ``lora_linears``) that hold fp8 weights."""
    layers = (lin for _, lins in model.lora_linears() for lin in lins.values())
    return [lin for lin in dict.fromkeys(layers) if fp8_weight(lin) is not None]


@torch.no_grad()
def quantize_model(model: Any) -> int:
    """Quantize the float base rows of every projection of a built model in place (per output
    channel, as on load; for callers that make their own weights). Returns the layer count;
    layers already holding fp8 rows are left as they are."""
    count = 0
    for lin in dict.fromkeys(lin for _, lins in model.lora_linears() for lin in lins.values()):
        if fp8_weight(lin) is not None:
            continue
        q, scale = quantize_fp8(lin.weight)
        lin.register_buffer("weight_fp8", q.contiguous())
        lin.register_buffer("weight_scale", scale[:, None].contiguous())
        with torch.no_grad():  # the float rows now hold exactly what the fp8 rows give
            lin.weight.copy_(dequantize_fp8(q, lin.weight_scale, lin.weight.dtype))
        count += 1
    return count


def drop_float_bases(model: Any) -> int:
    """Free the float base rows of every fp8 projection (``LoRALinear.drop_float_base``):
    the fp8 GEMM reads the fp8 rows alone. Returns the layer count."""
    layers = fp8_layers(model)
    for lin in layers:
        lin.drop_float_base()
    return len(layers)
