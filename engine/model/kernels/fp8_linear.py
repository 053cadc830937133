"""Triton: the augmented projection GEMM of an fp8 base (``fp8_aug_linear``).

An fp8 base keeps each projection's weight as e4m3 values with float32 scales
(``quant.py``: ``weight_fp8`` (N, K), ``weight_scale`` (N, G), group = K // G) and the LoRA A
rows of every slot in the compute dtype (``LoRALinear.lora_a``, E = S * L * R rows). Decode is
bound by reading the weights, so the GEMM reads the fp8 bytes as they are and converts them to
the activations' dtype in registers (weight-only quantization, W8A16): half the bytes of a
bf16 weight, no activation quantization. One launch writes the same (T, N + E) output as the
bf16 augmented GEMM (``x @ [W; A].T``), so the fused epilogues read it unchanged:

    y[t, n]     = sum_k x[t, k] * weight_fp8[n, k] * weight_scale[n, k // group]  (+ bias[n])
    y[t, N + e] = sum_k x[t, k] * a[e, k]

Shape of the launch, for the skinny decode GEMMs (T = 1..64 rows against 16-120 MB):

- swapped operands: each program computes a (BLOCK_N weight rows, BLOCK_M tokens) tile as
  ``dot(W tile, x tile^T)``; the converted weight tile is the dot's first operand, which the
  tensor cores read from registers (no second trip through shared memory), and the token
  count only sets the dot's narrow side (16..64);
- split-K: ``SPLIT_K`` programs share one output tile, each over K / SPLIT_K columns, so the
  4096-wide outputs (64 column tiles) still fill 132 SMs with loads in flight. Each writes
  its float32 partial to a workspace and bumps the tile's counter; the last to arrive sums
  the partials in split order (deterministic, whatever the arrival order), scales, adds the
  bias, stores, and resets the counter to 0 for the next launch. Launches using the counters
  must not overlap: one stream runs the forward (``_counters`` says why);
- A rows: the programs past the base tiles read bf16 A rows (no conversion, no scale) in the
  same launch: the LoRA shrink costs no extra launch, only its bytes (E x K x 2).

Grid ``((cdiv(N, BLOCK_N) + cdiv(E, BLOCK_N)), SPLIT_K, cdiv(T, BLOCK_M))``. Nothing but
``T`` shapes the launch, so it can be captured in a CUDA graph. Launch configurations come
from ``FP8_LINEAR_CONFIGS`` (launch_table.py): on sm_90 ``CONFIGS`` (the fastest of a
``benchmarks/fp8_gemm.py`` sweep) and a heuristic for shapes it lacks; elsewhere the heuristic
within a shared-memory budget that every fp8-capable GPU has. Semantics:
``fp8_aug_linear_torch`` (the twin: de-quantize, then one float32 GEMM).

At 1-2 tokens (``GEMV_MAX_TOKENS``) the same call runs the CUDA-core GEMV of
``fp8_gemv.py`` instead; both kernels share the split-K reduction of ``fp8_splitk.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from loraplex.engine.model.kernels.fp8_gemv import (
    GEMV_CONFIGS,
    GEMV_MAX_TOKENS,
    GEMV_TOKENS,
    Fp8GemvConfig,
    _launch_gemv,
    fp8_gemv_config,
)
from loraplex.engine.model.kernels.fp8_splitk import _COUNTERS, _store_tile, prepare_fp8_linear
from loraplex.engine.model.kernels.launch_table import (
    GENERIC,
    GENERIC_SMEM_BYTES,
    LaunchTable,
    Rule,
    device_sms,
)

__all__ = [
    "CONFIGS",
    "FP8_LINEAR_CONFIGS",
    "GEMV_CONFIGS",
    "GEMV_MAX_TOKENS",
    "GEMV_TOKENS",
    "Fp8GemvConfig",
    "Fp8LinearConfig",
    "fp8_gemv_config",
    "fp8_linear_config",
    "fp8_aug_linear",
    "fp8_aug_linear_torch",
    "aug_output",
    "check_operands",
    "prepare_fp8_linear",
]


@dataclass(frozen=True)
class Fp8LinearConfig:
    block_m: int = 16  # tokens per tile (the dot's narrow side)
    block_n: int = 64  # weight rows per tile
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


# (N, K, block_m) -> config: the fastest of a benchmarks/fp8_gemm.py sweep on sm_90, summed
# over the bucket's token counts; N is the base rows (8 slots' A rows of rank 16 rode along).
# Llama-3-8B: qkv, o, gate_up, down.
CONFIGS: dict[tuple[int, int, int], Fp8LinearConfig] = {
    (6144, 4096, 16): Fp8LinearConfig(16, 64, 128, 2, 4, 4),
    (6144, 4096, 32): Fp8LinearConfig(32, 64, 128, 2, 4, 4),
    (6144, 4096, 64): Fp8LinearConfig(64, 64, 256, 1, 4, 3),
    (4096, 4096, 16): Fp8LinearConfig(16, 64, 128, 4, 4, 4),
    (4096, 4096, 32): Fp8LinearConfig(32, 64, 128, 4, 4, 4),
    (4096, 4096, 64): Fp8LinearConfig(64, 64, 256, 2, 4, 3),
    (28672, 4096, 16): Fp8LinearConfig(16, 64, 128, 1, 4, 4),
    (28672, 4096, 32): Fp8LinearConfig(32, 64, 128, 1, 4, 4),
    (28672, 4096, 64): Fp8LinearConfig(64, 64, 256, 1, 4, 3),
    (4096, 14336, 16): Fp8LinearConfig(16, 64, 128, 4, 4, 4),
    (4096, 14336, 32): Fp8LinearConfig(32, 64, 128, 4, 4, 4),
    (4096, 14336, 64): Fp8LinearConfig(64, 64, 256, 2, 4, 3),
}


def _bucket(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64 if num_tokens <= 64 else 128


def smem_bytes(cfg: Fp8LinearConfig) -> int:
    """Shared memory the launch asks at most: ``num_stages`` buffers of the x tile and the
    weight tile converted to 16 bits (Triton's count on sm_90; sm_8x keeps one buffer fewer)."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * 2


def _heuristic(shape: Mapping[str, int], programs: int) -> Fp8LinearConfig:
    """Prefill (``block_m`` 128): a plain tiled GEMM, enough tiles without split-K. Decode:
    64-row weight tiles, K split while the grid is under ``programs`` and each split keeps >= 4
    K tiles; the K tile divides the scale groups."""
    bm, n, k, group = shape["block_m"], shape["n"], shape["k"], shape["group"]
    if bm == 128:
        bk = 64 if group == k or group % 64 == 0 else 32
        return Fp8LinearConfig(128, 128, bk, split_k=1, num_warps=8, num_stages=3)
    bk = 256 if bm <= 32 else 128
    while bk > 32 and group != k and group % bk:
        bk //= 2
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    bn = 64
    tiles = triton.cdiv(n, bn)
    split = 1
    while tiles * split < programs and k % (2 * split * bk) == 0 and k // (2 * split) >= 4 * bk:
        split *= 2
    return Fp8LinearConfig(bm, bn, bk, split_k=split, num_warps=4, num_stages=4)


def _generic(shape: Mapping[str, int]) -> Fp8LinearConfig:
    """The heuristic for ~2 programs per SM of the device, within ``GENERIC_SMEM_BYTES``:
    fewer stages (down to 2), then a narrower K tile (a divisor of the one before, so the
    scale groups and the split still divide)."""
    cfg = _heuristic(shape, 2 * shape["sms"])
    while smem_bytes(cfg) > GENERIC_SMEM_BYTES:
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def _tuned(cfg: Fp8LinearConfig) -> Callable[[Mapping[str, int]], Fp8LinearConfig | None]:
    """A measured row: taken where its K tile divides the weight's scale groups."""
    return lambda s: cfg if s["group"] == s["k"] or s["group"] % cfg.block_k == 0 else None


# sm_90 (H100 / H200): the measured shapes, then the heuristic sized for 132 SMs. Elsewhere the
# heuristic for the device's SMs within the generic shared-memory budget: the sm_90 rows'
# 256-wide K tiles at 3-4 stages ask 120-144 KB a block compiled for sm_89, more than an L4 /
# L40S / RTX 4090 gives (99 KB); the generic configs ask at most 72 KB there.
FP8_LINEAR_CONFIGS = LaunchTable(
    "fp8_linear",
    {
        "sm90": (
            *(Rule(_tuned(c), n=n, k=k, block_m=bm) for (n, k, bm), c in CONFIGS.items()),
            Rule(lambda s: _heuristic(s, 264)),  # ~2 programs on each of 132 SMs
        ),
        GENERIC: (Rule(_generic),),
    },
)


def fp8_linear_config(
    num_tokens: int, n: int, k: int, group: int, device: torch.device | str | None = None
) -> Fp8LinearConfig:
    """The launch configuration for ``num_tokens`` rows against an (n, k) fp8 weight whose
    scale groups span ``group`` columns of K (BLOCK_K must divide it when group < k), on
    ``device`` (None: the generic rule); ``FP8_LINEAR_CONFIGS``."""
    sms = device_sms(torch.device(device)) if device is not None else 132
    return FP8_LINEAR_CONFIGS.pick(
        device, block_m=_bucket(num_tokens), n=n, k=k, group=group, sms=sms
    )


@triton.jit
def _partial(x_ptr, w_ptr, ws_ptr, rows, row_ok, cols, col_ok, k_lo, k_hi, K,
             stride_xt, stride_wn, stride_sn,
             IS_BASE: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             NUM_STAGES: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """(BLOCK_N, BLOCK_M) float32: W[cols, k_lo:k_hi] @ x[rows, k_lo:k_hi]^T; fp8 rows of a base
    tile converted in registers (group scales applied per K tile), A rows as stored."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        k_ok = kk < K
        xt = tl.load(
            x_ptr + rows[None, :] * stride_xt + kk[:, None],
            mask=row_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # (BLOCK_K, BLOCK_M)
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + kk[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_K)
        if IEEE:
            part = tl.dot(w.to(xt.dtype), xt, input_precision="ieee")
        else:
            part = tl.dot(w.to(xt.dtype), xt)
        if IS_BASE and not PER_CHANNEL:
            s = tl.load(ws_ptr + cols * stride_sn + k0 // GROUP, mask=col_ok, other=0.0)
            acc += part * s[:, None]
        else:
            acc += part
    return acc


@triton.jit(do_not_specialize=["T"])
def _fp8_aug_linear_kernel(
    x_ptr, wq_ptr, ws_ptr, a_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    T, N, E, K,
    stride_xt, stride_wn, stride_sn, stride_an, stride_yt,
    GROUP: tl.constexpr,  # K columns per scale
    PER_CHANNEL: tl.constexpr,  # one scale per output channel (G = 1)
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 dot (no tf32)
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    base_tiles = tl.cdiv(N, BLOCK_N)
    k_len = K // SPLIT_K  # NOTE: the host checks K % (SPLIT_K * BLOCK_K) == 0 when split
    k_lo = pid_k * k_len
    k_hi = K if SPLIT_K == 1 else k_lo + k_len
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # tokens
    row_ok = rows < T
    if pid_n < base_tiles:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = _partial(x_ptr, wq_ptr, ws_ptr, rows, row_ok, cols, col_ok, k_lo, k_hi, K,
                       stride_xt, stride_wn, stride_sn, True, GROUP, PER_CHANNEL,
                       BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, IEEE)  # fmt: skip
        out_cols = cols
    else:
        cols = (pid_n - base_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < E
        acc = _partial(x_ptr, a_ptr, ws_ptr, rows, row_ok, cols, col_ok, k_lo, k_hi, K,
                       stride_xt, stride_an, stride_sn, False, GROUP, PER_CHANNEL,
                       BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, IEEE)  # fmt: skip
        out_cols = N + cols
    _store_tile(acc, y_ptr, part_ptr, count_ptr, ws_ptr, bias_ptr, rows, row_ok, cols, col_ok,
                out_cols, pid_n < base_tiles, pid_m * tl.num_programs(0) + pid_n, pid_k, T, N + E,
                stride_yt, stride_sn, SPLIT_K, PER_CHANNEL, HAS_BIAS)  # fmt: skip


def check_operands(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> int:
    """The scale group (K columns per scale); raises ValueError on inconsistent shapes (the
    fp8 GEMMs' shared check: x (T, K), weight (N, K), scales (N, G), A rows (E, K), bias)."""
    if x.dim() != 2 or weight_fp8.dim() != 2 or x.shape[1] != weight_fp8.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} against weight {tuple(weight_fp8.shape)}")
    n, k = weight_fp8.shape
    if weight_scale.dim() != 2 or weight_scale.shape[0] != n or k % weight_scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} for weight ({n}, {k})")
    if a is not None and (a.dim() != 2 or a.shape[1] != k or a.dtype != x.dtype):
        raise ValueError(f"A rows {tuple(a.shape)} {a.dtype}, want (E, {k}) {x.dtype}")
    if bias is not None and bias.shape[0] < n:
        raise ValueError(f"bias {tuple(bias.shape)} shorter than {n}")
    return k // weight_scale.shape[1]


def aug_output(x: torch.Tensor, width: int, out: torch.Tensor | None) -> torch.Tensor:
    """The (T, width) output in x's dtype of an augmented GEMM: ``out`` checked (contiguous
    columns), or a new one."""
    t = x.shape[0]
    if out is None:
        return torch.empty(t, width, dtype=x.dtype, device=x.device)
    if out.shape != (t, width) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, want ({t}, {width}) {x.dtype}")
    return out


def fp8_aug_linear_torch(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: (T, N + E) = x @ [de-quantized W; A].T (+ bias on the first N), computed in
    float32 and rounded once to x's dtype."""
    group = check_operands(x, weight_fp8, weight_scale, a, bias)
    w = weight_fp8.float() * weight_scale.float().repeat_interleave(group, dim=1)
    if a is not None:
        w = torch.cat([w, a.float()])
    y = x.float() @ w.t()
    if bias is not None:
        y[:, : weight_fp8.shape[0]] += bias[: weight_fp8.shape[0]].float()
    return y.to(x.dtype)


def fp8_aug_linear(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    a: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: Fp8LinearConfig | Fp8GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """(T, N + E): ``x`` (T, K) against fp8 ``weight_fp8`` (N, K) with ``weight_scale``
    (N, G) float32, then against the A rows ``a`` (E, K) in x's dtype; ``bias`` (>= N) added
    to the first N columns. One Triton launch (see the module docstring): the CUDA-core GEMV
    up to GEMV_MAX_TOKENS tokens (or with an ``Fp8GemvConfig``), else the tensor-core GEMM."""
    group = check_operands(x, weight_fp8, weight_scale, a, bias)
    if x.stride(1) != 1 or weight_fp8.stride(1) != 1 or (a is not None and a.stride(1) != 1):
        raise ValueError("x, weight_fp8 and A rows must be contiguous along K")
    t, k = x.shape
    n = weight_fp8.shape[0]
    e = a.shape[0] if a is not None else 0
    if config is None and 0 < t <= GEMV_MAX_TOKENS:
        config = fp8_gemv_config(t, n, k, group, e, x.device)
    cfg = config or fp8_linear_config(t, n, k, group, x.device)
    if group != k and group % cfg.block_k:
        raise ValueError(f"scale group {group} is not a multiple of BLOCK_K {cfg.block_k}")
    if cfg.split_k > 1 and k % (cfg.split_k * cfg.block_k):
        raise ValueError(f"K {k} is not a multiple of SPLIT_K x BLOCK_K of {cfg}")
    if isinstance(cfg, Fp8GemvConfig) and t > GEMV_TOKENS:
        raise ValueError(f"the GEMV takes at most {GEMV_TOKENS} tokens, got {t}")
    out = aug_output(x, n + e, out)
    if t == 0:
        return out
    if isinstance(cfg, Fp8GemvConfig):
        _launch_gemv(x, weight_fp8, weight_scale, a, bias, out, group, cfg)
        return out
    tiles = triton.cdiv(n, cfg.block_n) + triton.cdiv(e, cfg.block_n)
    grid = (tiles, cfg.split_k, triton.cdiv(t, cfg.block_m))
    part = counters = x  # unused without split-K
    if cfg.split_k > 1:
        if tiles * grid[2] > _COUNTERS:
            raise ValueError(f"{tiles * grid[2]} output tiles exceed the split-K counters")
        counters = prepare_fp8_linear(x.device)
        part = torch.empty(cfg.split_k, t, n + e, dtype=torch.float32, device=x.device)
    _fp8_aug_linear_kernel[grid](
        x, weight_fp8, weight_scale,
        a if a is not None else x, bias if bias is not None else x, out, part, counters,
        t, n, e, k,
        x.stride(0), weight_fp8.stride(0), weight_scale.stride(0),
        a.stride(0) if a is not None else 0, out.stride(0),
        GROUP=group, PER_CHANNEL=group == k, HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NUM_STAGES=cfg.num_stages, IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
