"""Attention of a speculative verification step, as its CUDA graph runs it (Llama-3-8B heads,
bf16, block 16), against a decode step's attention at the same streams: the prefill kernel
over every row of 1 + K tokens in a grid sized for the mixed graphs' 64-token rows
(``mixed_graphs.py``), alone (one launch, as the wide graphs run it now) at each key-range split
(``--parts``; "auto": ``prefill_partitions``), and as the graphs ran it before: unsplit, then
the decode kernel over each sequence's last row ("2 launches, 1 part").

    python -m benchmarks.verify_attention                    # streams 1 2 4 8, K 4, ctx 512
    python -m benchmarks.verify_attention --cold-l2 --ctx 512 2048

Each variant's output is checked against the float32 reference first. µs per layer; the last
columns scale the gap to verify - decode over the 8B model's 32 layers.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.graph_timing import graph_us
from loraplex.engine.mixed_graphs import MIXED_QMAX
from loraplex.engine.model.attention import AttentionMetadata, paged_attention_reference
from loraplex.engine.model.paged_attention import (
    device_sms,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_partitions,
)

HQ, HKV, D, BS = 32, 8, 128, 16


def build(streams: int, k: int, ctx: int, max_model_len: int, seed: int = 0) -> dict:
    """A scattered paged cache holding ``ctx`` + 1 + ``k`` tokens per stream, queries of the
    1 + ``k`` newest, tables ``max_model_len`` wide (the engine's)."""
    g = torch.Generator().manual_seed(seed)
    n = 1 + k
    total = ctx + n
    need = -(-total // BS)
    width = -(-max_model_len // BS)
    num_blocks = streams * need + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).view(streams, need)
    tables = torch.zeros(streams, width, dtype=torch.int32)
    tables[:, :need] = perm.int()
    dev = "cuda"
    kc = torch.randn(num_blocks, BS, HKV, D, generator=g).to(dev, torch.bfloat16)
    vc = torch.randn(num_blocks, BS, HKV, D, generator=g).to(dev, torch.bfloat16)
    q = torch.randn(streams * n, HQ, D, generator=g).to(dev, torch.bfloat16)
    qsl = torch.arange(streams + 1, dtype=torch.int32) * n
    return {
        "q": q, "k": kc, "v": vc, "tables": tables.to(dev), "qsl": qsl.to(dev),
        "ctx": torch.full((streams,), total, dtype=torch.int32, device=dev),
        "last": (qsl[1:] - 1).long().to(dev), "qsl_list": qsl.tolist(), "total": total,
        "decode_q": q[(qsl[1:] - 1).long().to(dev)].contiguous(),
    }  # fmt: skip


def verify_fn(c: dict, parts: int | None, out: torch.Tensor, two: bool = False):
    scale = D**-0.5

    def run() -> torch.Tensor:
        o = paged_prefill_attention(
            c["q"], c["k"], c["v"], c["tables"], c["qsl"], c["ctx"], MIXED_QMAX, scale,
            out=out, num_partitions=parts,
        )  # fmt: skip
        if not two:
            return o
        last = paged_decode_attention(
            c["q"].index_select(0, c["last"]), c["k"], c["v"], c["tables"], c["ctx"], scale
        )
        return o.index_copy_(0, c["last"], last)

    return run


def reference(c: dict) -> torch.Tensor:
    streams = c["ctx"].shape[0]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device="cuda"),
        block_tables=c["tables"], query_start_loc=c["qsl_list"],
        context_lens=[c["total"]] * streams, block_size=BS,
    )  # fmt: skip
    return paged_attention_reference(c["q"].float(), c["k"].float(), c["v"].float(), meta, D**-0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--k", type=int, default=4, help="proposed tokens per row")
    ap.add_argument("--ctx", type=int, nargs="+", default=[512])
    ap.add_argument("--max-model-len", type=int, default=4096, help="table width (the engine's)")
    ap.add_argument("--parts", nargs="+", default=["1", "2", "4", "8", "16", "auto"])
    ap.add_argument("--cold-l2", action="store_true", help="each launch after an L2 eviction")
    args = ap.parse_args()
    sms = device_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, K = {args.k}, tables {args.max_model_len} wide, "
          f"{'cold' if args.cold_l2 else 'warm'} L2, µs per layer")  # fmt: skip
    head = " | ".join(f"1 launch, parts {p}" for p in args.parts)
    print(f"\n| ctx | streams | decode | 2 launches, 1 part | {head} | auto picks "
          "| verify - decode x32 ms: before / auto |")  # fmt: skip
    print("|---:|---:|---:|---:|" + "---:|" * len(args.parts) + "---:|---|")
    for ctx in args.ctx:
        for s in args.streams:
            c = build(s, args.k, ctx, args.max_model_len)
            ref = reference(c)
            out = torch.empty_like(c["q"])
            times = {}
            for p in ["before", *args.parts]:
                if p == "before":
                    fn = verify_fn(c, 1, out, two=True)
                else:
                    fn = verify_fn(c, None if p == "auto" else int(p), out)
                got = fn().float()
                err = float((got - ref).norm() / ref.norm())
                if not err < 1e-2:
                    raise SystemExit(f"parts {p}, {s} streams: relative error {err:.3g}")
                times[p] = graph_us(fn, cold_l2=args.cold_l2, rep=50)
            dq = c["decode_q"]

            def dec(dq=dq, c=c) -> torch.Tensor:
                return paged_decode_attention(dq, c["k"], c["v"], c["tables"], c["ctx"], D**-0.5)

            dec()
            t_dec = graph_us(dec, cold_l2=args.cold_l2, rep=50)
            auto = prefill_partitions(s, HKV, MIXED_QMAX, args.max_model_len, 64, sms)
            gaps = [(times[p] - t_dec) * 32 / 1e3 for p in ("before", "auto") if p in times]
            cells = " | ".join(f"{times[p]:.1f}" for p in ["before", *args.parts])
            print(f"| {ctx} | {s} | {t_dec:.1f} | {cells} | {auto} | "
                  + " / ".join(f"{g:.2f}" for g in gaps) + " |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
