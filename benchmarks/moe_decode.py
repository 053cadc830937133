"""Decode steps of a mixture-of-experts model (Qwen3-30B-A3B shape) against its bandwidth floor.

    python -m benchmarks.moe_decode                      # on a GPU: bf16 random weights, ~61 GB
    python -m benchmarks.moe_decode --append BENCHMARKS.md
    python -m benchmarks.moe_decode --smoke              # tiny shape on CPU: checks the script
    python -m benchmarks.moe_decode --expert-lora --layers 24   # adapters on the experts too

Random weights are made on the device (no checkpoint). The model runner decodes batches of
sequences with ``--ctx`` tokens of KV each (the cache holds zeros: attention reads the same
bytes), one token a step, as CUDA graphs on a GPU; base rows only, or rows spread over N rank-16
adapters on q / k / v / o, with ``--expert-lora`` on every expert's gate_up and down as well.
``--layers`` cuts the decoder layers (a model of 8 slots with expert LoRA at the full 48 layers
needs ~75 GB: an H200).

The floor of a step counts the bytes it must read, over the device's measured copy bandwidth:
attention and router weights of every layer, the experts actually routed to (the distinct
experts of each layer's top-k over the batch, counted on an eager step of the same batch), the
LM head, the adapters' A / B used (on the experts: each distinct (adapter, routed expert) of a
layer's rank-16 A / B), and the KV read. Batch 1 reads top-k experts a layer; a
batch of 64 reads almost every expert, so the floor grows with the batch as the routing says.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from benchmarks.floor import copy_bandwidth, pct
from benchmarks.record import git_commit
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.moe.model import MoeForCausalLM
from loraplex.engine.model_runner import ModelRunner, StepItem

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
# ~94 GB of bf16 weights: an H200
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
}  # fmt: skip
TINY = dict(
    QWEN3_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
    num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
)  # fmt: skip
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B, "tiny": TINY}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 16


@torch.no_grad()
def random_moe(
    cfg: ModelConfig, max_loras: int, device: str, max_lora_rank: int = RANK
) -> MoeForCausalLM:
    """The model on ``device`` with random bf16 (CPU: float32) weights, std ~ 1/sqrt(fan_in)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = MoeForCausalLM(
        cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype, device=device
    )
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if name.endswith(("norm.weight", "layernorm.weight")):
            p.fill_(1.0)
        elif name.endswith("weight_aug"):
            lin = model.get_submodule(name.rsplit(".", 1)[0])
            lin.weight.normal_(0.0, lin.in_features**-0.5, generator=g)
        elif name.endswith(("w_gate_up", "w_down", "router", "lm_head")):
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        elif name == "embed_tokens":
            p.normal_(0.0, 1.0, generator=g)
    model.eval()
    return model


@torch.no_grad()
def write_adapters(model: MoeForCausalLM, n: int, experts: bool = False) -> None:
    """Rank-16 random LoRA on q / k / v / o of every layer into slots 0..n-1 (``experts``: on
    every expert's gate_up and down too, PEFT's fused form)."""
    g = torch.Generator(device=model.device).manual_seed(1)
    dev, dt = model.device, model.dtype
    for slot in range(n):
        for _, lora in model.expert_loras() if experts else []:
            e, h, i = lora.a_down.shape[1], lora.a_gate_up.shape[3], lora.width
            for role, d_in, d_out in (("gate_up", h, 2 * i), ("down", i, h)):
                a = torch.randn(RANK * e, d_in, generator=g, device=dev) * d_in**-0.5
                b = torch.randn(d_out, RANK * e, generator=g, device=dev) * 0.01
                lora.set(slot, role, None, a.to(dt), b.to(dt))
        for _, lins in model.lora_linears():
            for m in ATTN:
                lin = lins[m]
                s = lin.slice_index(m)
                d_out = lin.slice_offsets[s + 1] - lin.slice_offsets[s]
                a = torch.randn(RANK, lin.in_features, generator=g, device=model.device)
                b = torch.randn(d_out, RANK, generator=g, device=model.device) * 0.01
                lin.set_lora(
                    slot, m, (a * lin.in_features**-0.5).to(model.dtype), b.to(model.dtype)
                )


def adapter_bytes(cfg: ModelConfig, elem: int) -> int:
    """Bytes of one rank-16 adapter on q / k / v / o (A and B): what a step reads per adapter,
    and what its GPU slot holds."""
    shapes = cfg.lora_module_shapes()
    return cfg.num_layers * sum((shapes[m][0] + shapes[m][1]) * RANK for m in ATTN) * elem


def expert_adapter_bytes(cfg: ModelConfig, elem: int) -> int:
    """Bytes of one rank-16 adapter's A and B on one expert of one layer (gate_up and down)."""
    spec = cfg.moe
    assert spec is not None
    return 3 * (cfg.hidden_size + spec.expert_size) * RANK * elem


def step_bytes(
    model: MoeForCausalLM, distinct: list[int], batch: int, ctx: int, used: int, lora_pairs: int
) -> dict:
    """What one decode step must read (module docstring), by part."""
    cfg, elem = model.cfg, model.dtype.itemsize
    # every projection of every layer (a dense layer's MLP included), base rows
    lins = {id(lin): lin for _, layer in model.lora_linears() for lin in layer.values()}
    attn = sum(lin.out_features * lin.in_features * elem for lin in lins.values())
    blocks = model.sparse_blocks()
    router = sum(b.router.numel() * elem for b in blocks)
    experts = sum(n * b.expert_bytes() for n, b in zip(distinct, blocks, strict=True))
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem * batch * ctx
    head = model.lm_head.numel() * elem
    lora = used * adapter_bytes(cfg, elem)
    parts = {"attention": attn, "router": router, "experts": experts, "lm_head": head}
    expert_lora = lora_pairs * expert_adapter_bytes(cfg, elem)
    parts |= {"adapters": lora, "expert_adapters": expert_lora, "kv": kv}
    return parts


def run_case(model, runner, batch: int, n: int, args, bw: float) -> dict:
    bs, dev = runner.block_size, model.device
    per_seq = -(-(args.ctx + args.steps + 1) // bs)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    slots = [i % n if n else -1 for i in range(batch)]
    for s in range(n):
        runner.slot_ranks.set(s, RANK)
    g = torch.Generator().manual_seed(batch)
    vocab = model.cfg.vocab_size

    def items(step: int) -> list[StepItem]:
        toks = torch.randint(3, vocab, (batch,), generator=g).tolist()
        return [StepItem([toks[i]], args.ctx + step, tables[i], slots[i]) for i in range(batch)]

    # the routing of an eager step of this batch: distinct experts per layer
    graphs, runner.graphs = runner.graphs, None
    blocks = model.sparse_blocks()
    for b in blocks:
        b.routed = []
    runner.execute(items(0))
    distinct = [int(torch.unique(b.routed[-1]).numel()) for b in blocks]
    lora_pairs = 0  # distinct (adapter, routed expert) of every layer: the expert A / B read
    if args.expert_lora and n:
        row_slots = torch.tensor(slots, device=dev)[:, None]
        for b in blocks:
            keys = row_slots * b.spec.num_experts + b.routed[-1]  # (T, k)
            lora_pairs += int(torch.unique(keys[row_slots[:, 0] >= 0]).numel())
    for b in blocks:
        b.routed = None
    runner.graphs = graphs
    times, gpu = [], []
    for step in range(args.steps + 3):
        it = items(step)
        t0 = time.perf_counter()
        runner.execute(it)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if step >= 3:  # graph capture and warm-up first
            times.append(time.perf_counter() - t0)
            if runner.last_events is not None:
                gpu.append(runner.last_events[0].elapsed_time(runner.last_events[1]) / 1e3)
    parts = step_bytes(model, distinct, batch, args.ctx, min(n, batch), lora_pairs)
    floor = sum(parts.values()) / bw
    p50 = statistics.median(gpu or times)
    return {
        "adapters": n, "batch": batch, "experts": statistics.mean(distinct),
        "gb": sum(parts.values()) / 1e9, "floor_ms": floor * 1e3, "p50_ms": p50 * 1e3,
        "p99_ms": pct(gpu or times, 0.99) * 1e3, "wall_ms": statistics.median(times) * 1e3,
        "ratio": p50 / floor, "parts": parts,
    }  # fmt: skip


HEADER = (
    "| adapters | batch | experts / layer | GB / step | floor ms | p50 ms | p99 ms | wall ms "
    "| p50 / floor | LoRA overhead |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def fmt_row(r: dict, base: dict | None) -> str:
    over = f"{r['p50_ms'] / base['p50_ms'] - 1:+.1%}" if base and r["adapters"] else "-"
    return (
        f"| {r['adapters']} | {r['batch']} | {r['experts']:.1f} | {r['gb']:.2f} | "
        f"{r['floor_ms']:.3f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['wall_ms']:.3f} | "
        f"{r['ratio']:.2f} | {over} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--append", default=None, help="append the result table to this file")
    ap.add_argument("--expert-lora", action="store_true", help="adapters on the experts too")
    ap.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the shape's)"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, few steps")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.model_shape, args.ctx, args.steps, args.batches = "tiny", 16, 3, [1, 4]
    shape = dict(SHAPES[args.model_shape])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    cfg = ModelConfig.from_dict(shape)
    bw = copy_bandwidth()
    elem = 2 if device == "cuda" else 4
    print(f"{args.model_shape} ({cfg.num_layers} layers) on {device}; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s; slot bytes per rank-{RANK} attention adapter "
          f"{adapter_bytes(cfg, elem) / 1e6:.1f} MB", flush=True)  # fmt: skip
    if args.expert_lora:
        print(f"expert adapters: rank {RANK} on every expert's gate_up and down", flush=True)
    print(HEADER, flush=True)
    rows, base = [], {}
    for n in args.adapters:
        model = random_moe(cfg, n, device)
        write_adapters(model, n, args.expert_lora)
        blocks = max(args.batches) * (-(-(args.ctx + args.steps + 1) // 16)) + 1
        runner = ModelRunner(model, num_blocks=blocks, block_size=16,
                             max_model_len=args.ctx + args.steps + 16, graph_sizes=tuple(args.batches))  # fmt: skip
        for batch in args.batches:
            r = run_case(model, runner, batch, n, args, bw)
            if n == 0:
                base[batch] = r
            rows.append(r)
            print(fmt_row(r, base.get(batch)), flush=True)
        print("   bytes of the last case (GB): "
              + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in r["parts"].items()), flush=True)  # fmt: skip
        del model, runner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    dev_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    table = "\n".join(
        [
            f"\n## MoE decode ({args.model_shape}, {cfg.num_layers} layers"
            f"{', expert LoRA' if args.expert_lora else ''}): {time.strftime('%Y-%m-%d %H:%M')}, commit "
            f"{git_commit() or 'unknown'}, {dev_name}, copy {bw / 1e12:.2f} TB/s, ctx {args.ctx}, "
            f"`python -m benchmarks.moe_decode {' '.join(sys.argv[1:])}`\n",
            HEADER,
        ]
        + [fmt_row(r, base.get(r["batch"])) for r in rows]  # fmt: skip
    )
    print(table)
    if args.append:
        with open(args.append, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
