"""Build models through the registry, and load a HF safetensors checkpoint (single file or
sharded with an index) into one.

The model class comes from the registry (config.json's architecture), and so does the map from
checkpoint keys to its tensors. Only safetensors is read: no pickle, no code from the model
folder.

fp8 bases (``quant.py``): a pre-quantized fp8 checkpoint is read as published, and
``quantization="fp8"`` quantizes the projections of a float checkpoint on load. The fp8
weights and scales are kept on each ``LoRALinear``; on CPU the projections run on weights
de-quantized to the compute dtype, on CUDA the float base rows are freed once loaded and the
projections run the fp8 GEMM. NOTE: the model is built with float base rows, so loading
still peaks at the float size on the device.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog
import torch
from safetensors import safe_open

from loraplex.engine.config import QUANTIZATIONS
from loraplex.engine.model import registry
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.quant import (
    FP8_DTYPE,
    Fp8Format,
    Fp8Rows,
    dequantize_fp8,
    drop_float_bases,
    quantize_fp8,
    row_scales,
)
from loraplex.engine.model.tp import (
    TensorParallel,
    TensorParallelError,
    shard_config,
    shard_tensor,
)

if TYPE_CHECKING:
    from loraplex.engine.model.protocol import CausalLM

__all__ = ["build_model", "load_model", "ModelLoadError", "resolve_dtype"]

log = structlog.get_logger("loraplex.engine")


class ModelLoadError(RuntimeError):
    """The checkpoint is missing, incomplete or does not fit the config."""


def resolve_dtype(name: str, cfg: ModelConfig, device: str) -> torch.dtype:
    if name == "auto":
        if device == "cpu":
            return torch.float32
        name = cfg.torch_dtype or "bfloat16"
        if name == "float32":
            return torch.bfloat16  # serve fp32 checkpoints in bf16 on GPU, like vLLM
        if cfg.quantization is not None and name not in ("bfloat16", "float16"):
            return torch.bfloat16  # an fp8 checkpoint naming its storage dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(table)}")
    return table[name]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (only safetensors is supported)")
    return files


def build_model(
    cfg: ModelConfig,
    *,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_expert_loras: int | None = None,
) -> CausalLM:
    """The model of ``cfg``'s family, weights uninitialised (``load_model`` fills them).
    ``max_expert_loras``: a MoE base's expert-capable slots (None: every slot; ignored on a
    dense base)."""
    kw = {}
    if cfg.moe is not None and max_expert_loras is not None:
        kw["max_expert_loras"] = max_expert_loras
    model = registry.family(cfg.architecture).model(
        cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device, **kw
    )
    return cast("CausalLM", model)


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    quantization: str | None = None,
    tensor_parallel: TensorParallel | None = None,
    max_expert_loras: int | None = None,
) -> CausalLM:
    """The model of the checkpoint in ``path``, weights in ``dtype`` on ``device``.

    ``tensor_parallel``: build and load only this rank's shard (``tp.py``; the model then
    runs its collectives in ``tensor_parallel.group``).

    ``quantization``: None loads the checkpoint as it is stored (a pre-quantized fp8 checkpoint
    as fp8); "fp8" quantizes the projections of a float checkpoint on load (``quant.py``).
    An unsupported ``quantization_config`` fails before any tensor is read.
    """
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}")
    full_cfg, shard = cfg, None
    if tensor_parallel is not None and tensor_parallel.size > 1:
        shard = tensor_parallel.shard
        if quantization is not None:
            raise TensorParallelError("fp8 bases are not split over ranks yet")
        cfg = shard_config(full_cfg, shard)
    model = build_model(
        cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device,
        max_expert_loras=max_expert_loras,
    )  # fmt: skip
    if shard is not None:
        model.set_tensor_parallel(tensor_parallel)
    weights = registry.family(cfg.architecture).weights
    # data_ptr of each weight the checkpoint must fill -> (name, element count)
    expected = {t.data_ptr(): (name, t.numel()) for name, t in weights.units(model)}
    filled: dict[int, int] = {}
    fp8 = _Fp8Reader(model, cfg.quantization, quantize=quantization == "fp8")
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for file in _weight_files(path)
        ]
        where = {key: f for f in files for key in f.keys()}  # noqa: SIM118 (not a dict)
        for key, f in where.items():
            dst = weights.target(model, key)
            if dst is None:
                continue
            src = f.get_tensor(key)
            if shard is not None:
                src = shard_tensor(key, src, full_cfg, shard)
            if tuple(src.shape) != tuple(dst.shape):
                raise ModelLoadError(
                    f"{key}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}"
                )
            src = fp8.convert(key, src, dst, where)
            with torch.no_grad():
                dst.copy_(src.to(dtype))
            # a slice of a fused weight counts towards the unit it starts in
            unit = max((p for p in expected if p <= dst.data_ptr()), default=None)
            if unit is not None:
                filled[unit] = filled.get(unit, 0) + dst.numel()
    missing = [name for p, (name, n) in expected.items() if filled.get(p, 0) < n]
    if missing:
        raise ModelLoadError(f"checkpoint in {path} lacks weights for: {', '.join(missing[:5])}")
    fp8.finish(model.device, dtype)
    model.eval()
    return model


class _Fp8Reader:
    """fp8 weights of one load: de-quantizes pre-quantized tensors (their scales read by key),
    quantizes float projections when asked, and collects the fp8 rows (``quant.Fp8Rows``)."""

    def __init__(self, model: CausalLM, fmt: Fp8Format | None, *, quantize: bool) -> None:
        self.model = model
        self.fmt = fmt
        self.quantize = quantize
        self.rows = Fp8Rows(lin for _, lins in model.lora_linears() for lin in lins.values())
        self.method = "checkpoint" if fmt is not None else "on-load" if quantize else None

    def convert(self, key: str, src: torch.Tensor, dst: torch.Tensor, where: dict[str, Any]):
        """The tensor to copy into ``dst``: ``src``, or its fp8 values de-quantized."""
        q = scale = None
        if src.dtype == FP8_DTYPE:
            q, scale = src, self._scale(key, src, where)
        elif src.dtype.is_floating_point and src.element_size() == 1:
            raise ModelLoadError(f"{key}: fp8 dtype {src.dtype} is not served (only e4m3fn)")
        elif not self.quantize or self.fmt is not None:
            return src  # NOTE: an fp8 checkpoint's float weights stay as they are
        owner = self.rows.owner(dst)  # None: not a projection weight
        if q is None:
            if owner is None:
                return src
            q, per_row = quantize_fp8(src)
            scale = per_row[:, None]
        if owner is not None:
            self.rows.add(owner[0], owner[1], q, scale)
        return dequantize_fp8(q, scale, torch.float32)

    def _scale(self, key: str, q: torch.Tensor, where: dict[str, Any]) -> torch.Tensor:
        if self.fmt is None:
            raise ModelLoadError(f"{key} is fp8 but config.json has no quantization_config")
        if q.dim() != 2 or not key.endswith(".weight"):
            raise ModelLoadError(f"{key}: fp8 tensors are served for 2-D weights only")
        base = key.removesuffix("weight")
        name = next((base + k for k in self.fmt.scale_keys if base + k in where), None)
        if name is None:
            names = " or ".join(base + k for k in self.fmt.scale_keys)
            raise ModelLoadError(f"{key} is fp8 but the checkpoint has no {names}")
        try:
            return row_scales(where[name].get_tensor(name), *q.shape, self.fmt)
        except ValueError as e:
            raise ModelLoadError(f"{name}: {e}") from None

    def finish(self, device: torch.device, dtype: torch.dtype) -> None:
        """Keep the fp8 rows on their layers; say how the fp8 base runs."""
        try:
            layers = self.rows.attach(device)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        if not layers:
            return
        if device.type == "cuda":
            drop_float_bases(self.model)
            log.info("fp8_base", layers=layers, source=self.method, gemm="fp8 (W8A16)")
        else:
            log.info("fp8_base_dequantized", layers=layers, source=self.method,
                     dtype=str(dtype).removeprefix("torch."))  # fmt: skip
