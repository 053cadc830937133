"""Can a projection's LoRA run beside its base GEMM instead of after it?

At rank 64 with 8 slots and 32 streams the LoRA costs the step 1.32 ms, twice its bytes, and the
goal of 1.2 x the step's floor lies 0.19 ms above the step with no adapter at all
(BENCHMARKS.md, "Rank 64 at 32 streams"): the adapters' bytes must move while the base step
leaves bandwidth unused (the skinny GEMMs read at 64-93 % of the copy bandwidth, attention at
58 %), not after. Each projection (Llama-3-8B shapes, bf16, 8 rank-64 slots, rows grouped by
slot), timed in one CUDA graph with a cold L2 (graph_timing.py) as GEMM + epilogue:

    today        the augmented GEMM (base + A rows), the epilogue with the LoRA expand
    base         the base GEMM, the epilogue without LoRA (what the LoRA adds is today - base)
    side         fused.py's LORAPLEX_LORA_SIDE=1: the base GEMM on the main stream; on a side
                 stream the shrink (a GEMM of the A rows) and ``lora_expand_delta`` into an fp32
                 buffer; joined, the epilogue fed the delta (``delta=``)
    side-serial  side's launches on one stream (what the fork itself buys)
    gemm-only    the base GEMM alone; lora-only: side's shrink and delta alone (a perfect
                 overlap takes max(gemm-only, lora-only) + the epilogue)

(Two read-ahead forms timed here once, B into the L2 beside the GEMM and the o rows beside
attention, were slower and are gone: BENCHMARKS.md, "The LoRA beside the base GEMM, measured".)

    python -m benchmarks.lora_overlap [--batches 32 64] [--rank 64] [--loras 8] [--check]

``--check`` compares side's outputs with today's (bf16 roundings apart) before timing. On a
machine without a GPU the forks run in order, untimed (``check`` only; the tests do so).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable

import torch

from loraplex.engine.model.gemm import linear
from loraplex.engine.model.kernels import lora_add_rmsnorm, lora_qkv_rope, lora_silu_mul
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.lora.ops.expand_delta import ExpandDeltaConfig, lora_expand_delta

__all__ = ["VARIANTS", "projections", "check", "main"]

VARIANTS = (
    "today", "base", "side", "side-serial", "gemm-only", "lora-only",
)  # fmt: skip


class _Fork:
    """Run a body on a side stream beside the main stream's work, joined after (in a CUDA
    graph: a parallel branch); in order where there are no streams."""

    def __init__(self, device: torch.device) -> None:
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def beside(self):
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            yield

    def join(self) -> None:
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)


def projections(
    model, t: int, ctx_len: int = 512, *, triton_kernels: bool = True,
    expand: dict[str, ExpandDeltaConfig] | None = None,
) -> dict:  # fmt: skip
    """{projection: {variant: fn}} for one layer of ``model`` at batch ``t``; each fn returns
    the tensor its epilogue wrote. ``expand``: more ``lora_expand_delta`` configs by label, as
    variants "side LABEL" and "lora-only LABEL" (the default config's are "side", "lora-only")."""
    mc = model.cfg
    layer = model.layers[0]
    dev = layer.qkv_proj.weight_aug.device
    dtype = layer.qkv_proj.weight_aug.dtype
    g = torch.Generator(device=dev).manual_seed(0)
    lin0 = layer.qkv_proj
    num_loras = lin0.max_loras
    slots = (torch.arange(t, device=dev, dtype=torch.int32) * max(num_loras, 1) // t).int()
    mapping = LoRAMapping(slots, triton=triton_kernels)
    base_map = LoRAMapping(torch.full_like(slots, -1), triton=triton_kernels)
    bs = 16
    nblk = -(-(ctx_len + 1) // bs)
    kv_shape = (t * nblk + 1, bs, mc.num_kv_heads, mc.head_dim)
    k_cache = torch.randn(kv_shape, generator=g, device=dev).to(dtype)
    v_cache = torch.randn(kv_shape, generator=g, device=dev).to(dtype)
    tables = torch.arange(t * nblk, device=dev, dtype=torch.int32).view(t, nblk)
    pos = torch.full((t,), ctx_len, device=dev, dtype=torch.int64)
    smap = (tables[:, -1].long() * bs + (ctx_len % bs)).contiguous()
    q = torch.empty(t, mc.num_heads, mc.head_dim, dtype=dtype, device=dev)
    act = torch.empty(t, mc.intermediate_size, dtype=dtype, device=dev)
    h_out = torch.empty(t, mc.hidden_size, dtype=dtype, device=dev)
    residual = torch.randn(t, mc.hidden_size, generator=g, device=dev).to(dtype)
    w_norm = layer.post_attention_layernorm.weight
    eps = mc.rms_norm_eps
    rope = model.rope

    def x_of(k: int) -> torch.Tensor:
        return torch.randn(t, k, generator=g, device=dev).to(dtype)

    def qkv_epi(y, b, m, delta=None):
        lora_qkv_rope(y, b, m, pos, rope.cos, rope.sin, k_cache, v_cache, smap, q, delta=delta)
        return q

    def norm_epi(y, b, m, delta=None):
        res = residual.clone()  # the same residual each call (its own launch in every variant)
        lora_add_rmsnorm(y, res, b, m, w_norm, eps, h_out, delta=delta)
        return h_out

    def silu_epi(y, b, m, delta=None):
        lora_silu_mul(y, b, m, act, delta=delta)
        return act

    specs = {
        "qkv": (layer.qkv_proj, qkv_epi),
        "o": (layer.o_proj, norm_epi),
        "gate_up": (layer.gate_up_proj, silu_epi),
        "down": (layer.down_proj, norm_epi),
    }
    fork = _Fork(dev)
    out = {}
    for name, (lin, epi) in specs.items():
        x = x_of(lin.in_features)
        n = lin.out_features
        w_aug = lin.aug_rows(None)[0]
        w_base, a_rows = w_aug[:n], w_aug[n:]
        b = lin.lora_b
        shrink = torch.empty(t, a_rows.shape[0], dtype=dtype, device=dev)
        delta = torch.empty(t, n, dtype=torch.float32, device=dev)
        offsets = lin.slice_offsets

        def today(x=x, w=w_aug, b=b, epi=epi):
            return epi(linear(x, w), b, mapping)

        def base(x=x, w=w_base, epi=epi):
            return epi(linear(x, w), None, base_map)

        def side_lora(x=x, a=a_rows, b=b, sh=shrink, d=delta, off=offsets, cfg=None):
            torch.mm(x, a.t(), out=sh)
            if cfg is None:
                lora_expand_delta(sh, b, mapping, off, d)
            else:
                lora_expand_delta(sh, b, mapping, off, d, config=cfg)

        def side(x=x, w=w_base, epi=epi, lora=side_lora, d=delta, forked=True):
            with fork.beside() if forked else contextlib.nullcontext():
                lora()
            y = linear(x, w)
            if forked:
                fork.join()
            return epi(y, None, mapping, delta=d)  # the epilogue fed the delta

        out[name] = {
            "today": today,
            "base": base,
            "side": side,
            "side-serial": lambda side=side: side(forked=False),
            "gemm-only": lambda x=x, w=w_base: linear(x, w),
            "lora-only": lambda lora=side_lora, d=delta: lora() or d,
        }
        for label, cfg in (expand or {}).items():
            lora_cfg = functools.partial(side_lora, cfg=cfg)
            out[name][f"side {label}"] = functools.partial(side, lora=lora_cfg)
            out[name][f"lora-only {label}"] = lambda lora=lora_cfg, d=delta: lora() or d
    return out


def check(
    model, t: int, *, triton_kernels: bool = True, tol: float = 2e-2,
    expand: dict[str, ExpandDeltaConfig] | None = None,
) -> dict[str, float]:  # fmt: skip
    """Max abs difference of every side variant's output against today's, per
    projection; raises past ``tol`` (relative to today's largest value)."""
    diffs = {}
    fns_of = projections(model, t, triton_kernels=triton_kernels, expand=expand)
    for name, fns in fns_of.items():
        want = fns["today"]().float().clone()
        for variant in fns:
            if not variant.startswith("side"):
                continue
            got = fns[variant]().float()
            diff = (got - want).abs().max().item()
            scale = max(want.abs().max().item(), 1.0)
            if not diff <= tol * scale:
                raise AssertionError(f"{name} {variant}: max diff {diff:.3g} (scale {scale:.3g})")
            diffs[f"{name} {variant}"] = diff
    return diffs


def _time(fn: Callable[[], object]) -> float:
    from benchmarks.graph_timing import graph_us

    fn()
    return graph_us(fn, cold_l2=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--loras", type=int, default=8)
    ap.add_argument("--check", action="store_true", help="side against today before timing")
    ap.add_argument(
        "--expand", nargs="*", default=["16,128,4,0", "16,64,4,2", "16,256,8,3"],
        help="more lora_expand_delta configs to time in the side form: BLOCK_T,BLOCK_N,WARPS,STAGES",
    )  # fmt: skip
    args = ap.parse_args()
    expand = {e: ExpandDeltaConfig(*map(int, e.split(","))) for e in args.expand}
    variants = list(VARIANTS) + [f"{v} {e}" for e in expand for v in ("side", "lora-only")]
    from benchmarks.synthetic import LLAMA3_8B, random_model

    model = random_model(
        dict(LLAMA3_8B, num_hidden_layers=1), max_loras=args.loras, max_lora_rank=args.rank
    )
    layer = model.layers[0]
    for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        lin.lora_a.normal_(0, 0.01)
        lin.lora_b.normal_(0, 0.01)
    rows = []
    for t in args.batches:
        if args.check:
            diffs = check(model, t, expand=expand)
            print(f"T={t} check:", {k: round(v, 4) for k, v in diffs.items()})
        for name, fns in projections(model, t, expand=expand).items():
            us = {v: _time(fns[v]) for v in variants}
            rows.append((name, t, us))
            print(name, t, " ".join(f"{v} {x:.1f}" for v, x in us.items()), flush=True)
    print("\n| projection | T | " + " | ".join(variants) + " | LoRA today | LoRA side |")
    print("|---|---:|" + "---:|" * (len(variants) + 2))
    for name, t, us in rows:
        cells = " | ".join(f"{us[v]:.1f}" for v in variants)
        print(
            f"| {name} | {t} | {cells} | {us['today'] - us['base']:.1f} "
            f"| {us['side'] - us['base']:.1f} |"
        )
    for t in args.batches:
        tot = {v: sum(us[v] for _, tt, us in rows if tt == t) for v in variants}
        print(f"T={t} per layer µs: " + ", ".join(f"{v} {x:.1f}" for v, x in tot.items()))


if __name__ == "__main__":
    main()
