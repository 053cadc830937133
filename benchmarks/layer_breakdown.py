"""Where one decode layer's GPU time goes (Llama-3-8B shapes, bf16): each launch of the fused
GPU forward timed alone with CUDA graphs, with and without LoRA slots; GEMMs under the BLAS
backend the engine picks (``model/gemm.py``), rows grouped by slot; the LM head once per step.

    python -m benchmarks.layer_breakdown [--batches 1 32 64 128] [--loras 0 8 32]
    python -m benchmarks.layer_breakdown --rank 64 [--bound 8]   # slots of rank 64, a step
                                                                  # reading ranks < bound only
    python -m benchmarks.layer_breakdown --cold-l2   # each launch with its inputs out of L2, as
                                                     # in the step (benchmarks/graph_timing.py)
    python -m benchmarks.layer_breakdown --launch-only 3   # untimed, for ncu (gpu_checks.sh ncu)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.graph_timing import graph_us
from benchmarks.synthetic import LLAMA3_8B, random_model
from loraplex.engine.model import gemm
from loraplex.engine.model.gemm import linear
from loraplex.engine.model.kernels import lora_add_rmsnorm, lora_qkv_rope, lora_silu_mul
from loraplex.engine.model.lora.mapping import LoRAMapping
from loraplex.engine.model.paged_attention import paged_decode_attention

COLD_L2 = False  # --cold-l2: every launch after an L2 eviction, as after the step's GEMMs


def bench(fn) -> float:
    fn()  # compiled before any capture
    return graph_us(fn, cold_l2=COLD_L2, rep=50)  # µs


def case(model, loras: int, t: int, ctx_len: int, bound: int | None = None) -> dict[str, float]:
    """Time every launch of one decode layer at batch ``t``."""
    return {k: bench(fn) for k, fn in launches(model, loras, t, ctx_len, bound).items()}


def launches(model, loras: int, t: int, ctx_len: int, bound: int | None = None) -> dict:
    """Every launch of one decode layer at batch ``t`` (and the LM head), by name."""
    mc = model.cfg
    layer = model.layers[0]
    dev = "cuda"
    h = torch.randn(t, mc.hidden_size, dtype=torch.bfloat16, device=dev)
    residual = torch.randn_like(h)
    # rows grouped by slot, as the engine sends them
    slots = (torch.arange(t, device=dev, dtype=torch.int32) * max(loras, 1) // t).to(torch.int32)
    if loras == 0:
        slots = torch.full((t,), -1, device=dev, dtype=torch.int32)
    bs = 16
    nblk = -(-(ctx_len + 1) // bs)
    k_cache = torch.randn(
        t * nblk + 1, bs, mc.num_kv_heads, mc.head_dim, dtype=torch.bfloat16, device=dev
    )
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(t * nblk, device=dev, dtype=torch.int32).view(t, nblk)
    ctx = torch.full((t,), ctx_len + 1, device=dev, dtype=torch.int32)
    pos = torch.full((t,), ctx_len, device=dev, dtype=torch.int64)
    smap = (tables[:, -1].long() * bs + (ctx_len % bs)).contiguous()
    q = torch.empty(t, mc.num_heads, mc.head_dim, dtype=torch.bfloat16, device=dev)
    act = torch.empty(t, mc.intermediate_size, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(h)
    mods = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    # the step's LoRA metadata, as fused_forward's (``bound``: its rank bucket, model/lora/ranks.py)
    mapping = LoRAMapping(slots, triton=True, rank_bound=bound)
    w_qkv, w_o, w_gu, w_d = (m.aug_rows(bound)[0] for m in mods)
    qkv = linear(h, w_qkv)
    o = linear(q.view(t, -1), w_o)
    gu = linear(h, w_gu)
    d = linear(act, w_d)
    w = layer.post_attention_layernorm.weight
    gemm.tune([w_qkv, w_o, w_gu, w_d, model.lm_head], t)  # as at graph capture
    parts = {
        "qkv gemm": lambda: linear(h, w_qkv),
        "qkv_rope": lambda: lora_qkv_rope(qkv, layer.qkv_proj.lora_b, mapping, pos, model.rope.cos, model.rope.sin, k_cache, v_cache, smap, q),
        "attention": lambda: paged_decode_attention(q, k_cache, v_cache, tables, ctx, layer.scale),
        "o gemm": lambda: linear(q.view(t, -1), w_o),
        "add_rmsnorm": lambda: lora_add_rmsnorm(o, residual, layer.o_proj.lora_b, mapping, w, 1e-5, out),
        "gate_up gemm": lambda: linear(h, w_gu),
        "silu_mul": lambda: lora_silu_mul(gu, layer.gate_up_proj.lora_b, mapping, act),
        "down gemm": lambda: linear(act, w_d),
        "add_rmsnorm(down)": lambda: lora_add_rmsnorm(d, residual, layer.down_proj.lora_b, mapping, w, 1e-5, out),
    }  # fmt: skip
    parts["lm_head (per step)"] = lambda: linear(h, model.lm_head).float()
    return parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128])
    ap.add_argument("--loras", type=int, nargs="+", default=[0, 8, 32])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16, help="max_lora_rank of the slots")
    ap.add_argument("--bound", type=int, default=None, help="rank rows a step reads")
    ap.add_argument("--cold-l2", action="store_true", help="each launch after an L2 eviction")
    ap.add_argument(
        "--launch-only", type=int, default=0, metavar="N",
        help="run every launch N times eagerly, untimed (for a profiler: gpu_checks.sh ncu)",
    )  # fmt: skip
    args = ap.parse_args()
    global COLD_L2
    COLD_L2 = args.cold_l2
    cfg = dict(LLAMA3_8B, num_hidden_layers=1)
    rows = []
    for loras in args.loras:
        model = random_model(cfg, max_loras=loras, max_lora_rank=args.rank)
        layer = model.layers[0]
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            if lin.lora_b is not None:
                lin.lora_a.normal_(0, 0.01)
                lin.lora_b.normal_(0, 0.01)
        for t in args.batches:
            if args.launch_only:  # inside NVTX range "layer", in the order of ``launches``
                parts = launches(model, loras, t, args.ctx, args.bound)
                for fn in parts.values():
                    fn()  # compiled, BLAS heuristics settled: outside the profiled range
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("layer")
                for fn in parts.values():
                    for _ in range(args.launch_only):
                        fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                print(f"loras {loras} batch {t}: {len(parts)} launches x{args.launch_only}")
                continue
            times = case(model, loras, t, args.ctx, args.bound)
            rows.append((loras, t, times))
            total = sum(v for k, v in times.items() if "per step" not in k)
            print(
                f"loras {loras} batch {t}: total {total:.1f} µs/layer (x32 = {total * 32 / 1e3:.2f} ms)"
            )
            print("   " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)
        del model
        torch.cuda.empty_cache()
    if not rows:
        return
    names = list(rows[0][2])
    print("\n| loras | batch | " + " | ".join(names) + " | total µs | x32 ms |")
    print("|---:|---:|" + "---:|" * (len(names) + 2))
    for loras, t, times in rows:
        total = sum(v for k, v in times.items() if "per step" not in k)
        cells = " | ".join(f"{times[k]:.1f}" for k in names)
        print(f"| {loras} | {t} | {cells} | {total:.1f} | {total * 32 / 1e3:.2f} |")


if __name__ == "__main__":
    main()
