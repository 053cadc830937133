"""Linear layers with slot-stacked LoRA buffers.

A ``LoRALinear`` is one base projection, possibly fused from several original modules
(qkv = q, k, v; gate_up = gate, up). Its LoRA state is one buffer pair for all slots:

    lora_a: (S, L, R, in)        S slices, L slots, R = max_lora_rank (zero beyond each rank);
                                 a strided view of weight_aug's A rows (rank-major, below)
    lora_b: (L, N_total, R)      slice s owns rows slice_offsets[s] : slice_offsets[s+1];
                                 stored (L, R, N_total) (a permuted view): the rows of ranks
                                 < r_b of a slot are one contiguous prefix, so an expand over
                                 r_b rank rows reads only those bytes

The base weight and every slot's A share one "augmented" matrix, so one GEMM gives both the
base output and every slot's shrink (the fused GPU decode path, model/fused.py). The A rows
are rank-major: rank index r of every slice and slot before rank index r + 1, so the rows of
ranks < r_b of all slots are one prefix and a step whose adapters have rank <= r_b reads only
``aug_rows(r_b)`` (model/lora/ranks.py picks r_b per step):

    weight_aug: (N_total + R*S*L, in) = [W; A[:, :, 0]; A[:, :, 1]; ...; A[:, :, R-1]]
    row N_total + (r*S + s)*L + slot = A[s, slot, r]
    (x @ weight_aug[:N_total + r_b*S*L].T)[t, N_total + (r*S + s)*L + slot] = x[t] . A[s, slot, r]

forward(x) = x W^T (+ bias), then each token adds its slot's delta (scale folded into B).
DoRA slots also scale their rows' base output first (``dora_scale``, model/lora/dora.py).

CPU path: ``set_base_layout(transposed=True)`` (the model runner's choice) stores the base rows
of ``weight_aug`` as the bytes of W^T (in, N_total), in place: a GEMM of a few rows against a
row-major (in, N) matrix runs about twice as fast on CPU BLAS as against W (N, in) (F.linear),
at no extra memory. ``weight`` is the logical (N_total, in) view in either layout; the A rows
are untouched.

fp8 bases on CUDA (``model/quant.py``): ``drop_float_base()`` frees the float base rows once
``weight_fp8`` / ``weight_scale`` hold them; ``weight_aug`` then holds only the A rows
(E, in) and the projection runs the fp8 GEMM (``kernels/fp8_linear.py``); ``weight`` is then a
de-quantized temporary (DoRA's norms at load, the reference forward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from loraplex.engine.model.kernels.fp8_linear import fp8_aug_linear, fp8_aug_linear_torch
from loraplex.engine.model.kernels.fp8_w8a8 import fp8_w8a8_linear, fp8_w8a8_linear_torch
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping
from loraplex.engine.model.lora.ops import add_lora
from loraplex.engine.model.lora.ops.dora import apply_dora
from loraplex.engine.model.lora.ops.runs import add_lora_runs

__all__ = ["LoRALinear"]


def _b_buffer(num_slots: int, n: int, rank: int, kw: dict) -> torch.Tensor:
    """Zeros (L, N, R) stored rank-major per slot, (L, R, N) (NOTE: clone / empty_like keep
    these strides; the kernels read any)."""
    return torch.zeros(num_slots, rank, n, **kw).permute(0, 2, 1)


def _a_view(rows: torch.Tensor, num_slices: int, num_slots: int, rank: int) -> torch.Tensor:
    """The logical (S, L, R, in) view of rank-major A rows (R*S*L, in)."""
    return rows.view(rank, num_slices, num_slots, rows.shape[1]).permute(1, 2, 0, 3)


class LoRALinear(torch.nn.Module):
    def __init__(
        self,
        in_features: int,
        slices: dict[str, int],
        *,
        bias: bool,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.slice_names = tuple(slices)
        offsets = [0]
        for width in slices.values():
            offsets.append(offsets[-1] + width)
        self.slice_offsets = tuple(offsets)
        self.out_features = offsets[-1]
        kw = {"dtype": dtype, "device": device}
        self.max_loras = max_loras
        self.slot_writes = (
            0  # per-module writes (set_lora / reset_lora): slot_buffers.py's zero state
        )
        self.max_rank = max_rank
        n, extra = self.out_features, len(slices) * max_loras * max_rank
        self.weight_aug = torch.nn.Parameter(torch.zeros(n + extra, in_features, **kw), False)
        # NOTE: the bias is zero beyond N: shrink columns get none
        self.bias_aug = torch.nn.Parameter(torch.zeros(n + extra, **kw), False) if bias else None
        self.base_transposed = False  # base rows of weight_aug hold W^T's bytes (CPU path)
        self.float_base = True  # False: the base rows live only in weight_fp8 (fp8 base)
        # fp8 base: inputs of at least this many tokens run W8A8 (``fp8_gemm``); None: never
        self.w8a8_min_tokens: int | None = None
        self.lora_a: torch.Tensor | None = None
        lora_b = _b_buffer(max_loras, n, max_rank, kw) if max_loras > 0 else None
        self.register_buffer("lora_b", lora_b)
        # DoRA row scales per slot (L + 1, N_total): ones but where a DoRA adapter's slot
        # holds g; row L (index -1, base rows) stays ones. Read only by steps with DoRA rows
        # (the fused epilogues: only rows whose slot ``dora_on`` flags).
        dora = torch.ones(max_loras + 1, n, **kw) if max_loras > 0 else None
        self.register_buffer("dora_scale", dora)
        on = torch.zeros(max_loras + 1, dtype=torch.int32, device=device) if max_loras else None
        self.register_buffer("dora_on", on)
        if max_loras > 0:
            self.lora_a = _a_view(self.weight_aug[n:], len(slices), max_loras, max_rank)

    @property
    def weight(self) -> torch.Tensor:
        """The base weight (N_total, in), a strided view when ``base_transposed``; with the
        float base dropped, the fp8 rows de-quantized (a new tensor)."""
        if not self.float_base:
            n, k = self.weight_fp8.shape
            g = self.weight_scale.shape[1]  # (N, G) scales, as quant.dequantize_fp8
            w = self.weight_fp8.float().view(n, g, k // g) * self.weight_scale[:, :, None]
            return w.view(n, k).to(self.weight_aug.dtype)
        base = self.weight_aug[: self.out_features]
        if self.base_transposed:
            return base.view(self.in_features, self.out_features).t()
        return base

    @torch.no_grad()
    def set_base_layout(self, transposed: bool) -> None:
        """Store the base rows of ``weight_aug`` as W (N, in) or as W^T (in, N), in place."""
        if transposed == self.base_transposed or not self.float_base:
            return  # NOTE: an fp8 base has no float rows to lay out
        w = self.weight.clone()  # (N, in), logical
        region = self.weight_aug.data[: self.out_features]
        if transposed:
            region.view(self.in_features, self.out_features).copy_(w.t())
        else:
            region.copy_(w)
        self.base_transposed = transposed

    @property
    def shrink_rows(self) -> torch.Tensor | None:
        """The A rows of every slot (S*L*R, in) as one matrix, or None without slots."""
        rows = self.weight_aug if not self.float_base else self.weight_aug[self.out_features :]
        return rows if rows.shape[0] else None

    def aug_rows(self, rank_bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) prefix of the augmented GEMM: base rows (if float) and the A rows of
        ranks < ``rank_bound`` of every slice and slot (all R when None)."""
        n = self.out_features
        rb = self.max_rank if rank_bound is None else min(rank_bound, self.max_rank)
        rows = len(self.slice_names) * self.max_loras * rb
        end = (n if self.float_base else 0) + rows
        bias = None if self.bias_aug is None else self.bias_aug[: n + rows]
        return self.weight_aug[:end], bias

    @torch.no_grad()
    def drop_float_base(self) -> None:
        """Free the float base rows of ``weight_aug`` (the fp8 rows must be attached): only
        the A rows stay, in a new (E, in) tensor, with ``lora_a`` a view of it. Call before
        anything holds ``lora_a`` (slot writers, graphs)."""
        if not self.float_base:
            return
        if getattr(self, "weight_fp8", None) is None or self.base_transposed:
            raise ValueError("drop_float_base needs fp8 rows and the (N, in) layout")
        rows = self.weight_aug.data[self.out_features :].clone()
        self.weight_aug = torch.nn.Parameter(rows, False)
        if self.lora_a is not None:
            self.lora_a = _a_view(rows, len(self.slice_names), self.max_loras, self.max_rank)
        self.float_base = False

    def dora_rows(self) -> DoraRows | None:
        """The DoRA tables the fused epilogues read (None without LoRA slots)."""
        if self.dora_scale is None or self.dora_on is None:
            return None
        return DoraRows(self.dora_scale, self.dora_on, self.bias)

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.bias_aug is None else self.bias_aug[: self.out_features]

    def slice_index(self, module: str) -> int:
        return self.slice_names.index(module)

    def set_lora(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one module's A (r, in) and scaled B (out, r) into ``slot``."""
        assert self.lora_a is not None and self.lora_b is not None
        s = self.slice_index(module)
        r = a.shape[0]
        self.slot_writes += 1
        lo, hi = self.slice_offsets[s], self.slice_offsets[s + 1]
        self.lora_a[s, slot, :r].copy_(a, non_blocking=True)
        self.lora_a[s, slot, r:].zero_()
        self.lora_b[slot, lo:hi, :r].copy_(b, non_blocking=True)
        self.lora_b[slot, lo:hi, r:].zero_()

    def reset_lora(self, slot: int, module: str | None = None) -> None:
        """Zero one module's slice of ``slot`` (or every slice when module is None)."""
        assert self.lora_a is not None and self.lora_b is not None
        self.slot_writes += 1
        if module is None:
            self.lora_a[:, slot].zero_()
            self.lora_b[slot].zero_()
            return
        s = self.slice_index(module)
        self.lora_a[s, slot].zero_()
        self.lora_b[slot, self.slice_offsets[s] : self.slice_offsets[s + 1]].zero_()

    def fp8_gemm(self, tokens: int, kernels: bool) -> Callable[..., torch.Tensor]:
        """The fp8 base's GEMM for an input of ``tokens`` rows (same arguments: x, weight_fp8,
        weight_scale, A rows, bias): W8A8 (kernels/fp8_w8a8.py) from ``w8a8_min_tokens`` on,
        else weight-only (kernels/fp8_linear.py); ``kernels``: the GPU kernels, else the twins."""
        if self.w8a8_min_tokens is not None and tokens >= self.w8a8_min_tokens:
            return fp8_w8a8_linear if kernels else fp8_w8a8_linear_torch
        return fp8_aug_linear if kernels else fp8_aug_linear_torch

    def forward(self, x: torch.Tensor, mapping: LoRAMapping | None) -> torch.Tensor:
        if not self.float_base:  # fp8 base rows only: the fp8 GEMM (its twin off CUDA)
            gemm = self.fp8_gemm(x.shape[0], x.is_cuda)
            y = gemm(x.contiguous(), self.weight_fp8, self.weight_scale, None, self.bias)
        elif self.base_transposed:  # x @ W^T on the row-major (in, N) matrix
            wt = self.weight_aug[: self.out_features].view(self.in_features, self.out_features)
            bias = self.bias
            y = torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt)  # (T, N_total)
        else:
            y = F.linear(x, self.weight, self.bias)  # (T, N_total)
        if mapping is not None and mapping.dora:
            apply_dora(y, self.dora_scale, self.bias, mapping.token_slots)
        if mapping is None or not mapping.has_lora or self.lora_a is None:
            return y
        if mapping.runs is not None and y.dtype == torch.float32 and not mapping.triton:
            # rows grouped by slot (CPU path): row slices, no gather / scatter
            add_lora_runs(y, x, self.lora_a, self.lora_b, self.slice_offsets, mapping.runs)
        else:
            add_lora(y, x, self.lora_a, self.lora_b, self.slice_offsets, mapping)
        return y
