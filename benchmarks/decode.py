"""Decode throughput of the engine on a Llama-3-8B-shaped model against the bandwidth floor.

    python -m benchmarks.decode                       # on a GPU, a few minutes
    python -m benchmarks.decode --append BENCHMARKS.md
    python -m benchmarks.decode --smoke               # tiny model on CPU: checks the script

Random bf16 weights are made on the GPU; rank-16 adapters on all 7 linear modules are written
as PEFT folders on local disk and loaded through the engine (fetch, verify, preflight, stage,
H2D). For base-only and 1 / 8 / 32 distinct adapters, batches of requests with ~512-token
prompts decode together; the step log gives p50 / p99 decode-step times (steps with every
request decoding). floor = (base weights + used adapters' A/B + KV read) / copy bandwidth
measured in the same run. The HF PEFT peer (``adapter_names`` mixed batches, ctx 128 + 64
new tokens) runs in the same process. ``--coldload`` also times decode steps while a cold
adapter loads next to them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.floor import base_bytes, copy_bandwidth, kv_bytes, pct
from benchmarks.record import git_commit
from benchmarks.synthetic import LLAMA3_8B, random_model, write_adapter, write_model_config
from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams


async def run_batch(engine, batch: int, names: list[str | None], ctx: int, steps: int, seed: int):
    g = random.Random(seed)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    vocab = engine.testing.executor.model.cfg.vocab_size
    prompts = [[g.randrange(vocab // 8, vocab - 1) for _ in range(ctx)] for _ in range(batch)]
    engine.testing.step_log.clear()

    async def one(i):
        n = 0
        async for out in engine.generate(prompts[i], params, adapter=names[i % len(names)]):
            n += len(out.token_ids)
        return n

    t0 = time.perf_counter()
    produced = sum(await asyncio.gather(*(one(i) for i in range(batch))))
    wall = time.perf_counter() - t0
    log = list(engine.testing.step_log)
    full = [e for e in log if e.decode and e.rows == batch][3:]  # every row decodes; skip capture
    gpu = [e.gpu_ms / 1e3 for e in full if e.gpu_ms is not None]
    host = [e.host_s for e in full]
    steps = [e.seconds for e in full]
    return {"wall": wall, "tokens": produced, "steps": steps, "gpu": gpu, "host": host, "log": log}


async def engine_cases(args, bw, adapters: list[Path], model_dir: Path, rows: list[dict]):
    cases = [(q, n, p) for n in args.adapters for q in args.quantization for p in args.modes]
    for quant, n, pipelined in cases:
        model = random_model(args.cfg, max_loras=n, max_lora_rank=16, device=args.device)
        cfg = EngineConfig(
            quantization=None if quant == "none" else "fp8",
            fp8_w8a8_min_tokens={"fp8-w8a8": args.w8a8_min_tokens, "fp8-w8a16": None}.get(
                quant, "auto"
            ),
            model=str(model_dir), device=args.device, dtype="bfloat16", max_loras=n,
            max_cpu_loras=max(n, 1), max_lora_rank=16, max_num_seqs=max(args.batches),
            max_num_batched_tokens=16384, kv_cache_bytes=args.kv_gb << 30, max_model_len=4096,
            enable_prefix_caching=False, async_scheduling=pipelined,
        )  # fmt: skip
        async with AsyncEngine(cfg, model=model) as engine:
            wbytes = base_bytes(model)
            names: list[str | None] = [None]
            if n:
                names = []
                for i in range(n):
                    await engine.add_adapter(f"a{i}", str(adapters[i]))
                    names.append(f"a{i}")
            for batch in args.batches:
                used = names[: min(len(names), batch)]
                await run_batch(engine, batch, used, args.ctx, 8, seed=1)  # warm-up + graphs
                r = await run_batch(engine, batch, used, args.ctx, args.steps, seed=2)
                a_bytes = (len(used) if n else 0) * args.adapter_bytes
                floor = (
                    wbytes + a_bytes + kv_bytes(args.cfg, batch, args.ctx + args.steps // 2)
                ) / bw
                if args.dump_steps:
                    slow = sorted(r["log"], key=lambda e: -e.seconds)[:8]
                    print(f"   {len(r['log'])} steps, wall {r['wall']:.2f}s; slowest (ms, rows, "
                          "tokens, decode, pipelined):",
                          [(round(e.seconds * 1e3, 1), e.rows, e.tokens, e.decode, e.pipelined)
                           for e in slow])  # fmt: skip
                p50, p99 = statistics.median(r["steps"]), pct(r["steps"], 0.99)
                gpu = statistics.median(r["gpu"]) if r["gpu"] else float("nan")
                host = statistics.median(r["host"]) if r["host"] else float("nan")
                loop = (r["wall"] - sum(e.seconds for e in r["log"])) / max(len(r["log"]), 1)
                print(
                    f"   host before queueing {host * 1e3:.2f} ms; loop between steps {loop * 1e3:.2f} ms"
                )
                row = {
                    "weights": "bf16" if quant == "none" else quant, "adapters": n, "batch": batch, "pipelined": pipelined, "floor_ms": floor * 1e3, "p50_ms": p50 * 1e3,
                    "gpu_ms": gpu * 1e3,
                    "p99_ms": p99 * 1e3, "ratio": p50 / floor, "decode_tok_s": batch / p50,
                    "e2e_tok_s": r["tokens"] / r["wall"],
                }  # fmt: skip
                rows.append(row)
                print(fmt_row(row), flush=True)
            if n == 8 and not args.no_hf and pipelined:
                for batch in (8, 32):  # the HF PEFT peer's workload: ctx 128 + 64 new tokens
                    await run_batch(engine, batch, names, 128, 8, seed=6)
                    r = await run_batch(engine, batch, names, 128, 64, seed=7)
                    rows.append(
                        {"hf_workload": True, "batch": batch, "tok_s": r["tokens"] / r["wall"]}
                    )
                    print(rows[-1], flush=True)
            if args.coldload and n and pipelined:
                await coldload(engine, args, names, rows)
            if args.profile and pipelined:
                await profile(engine, names, args)
        del model, engine
        gc.collect()
        torch.cuda.empty_cache()


async def coldload(engine, args, names, rows):
    """Decode batch 64 on resident adapters while a cold adapter loads (dynamic add)."""
    cold_dir = Path(args.workdir) / "cold"
    write_adapter(cold_dir, args.cfg, rank=16, seed=999)
    batch = 64
    used = names[:8]

    async def late():
        await asyncio.sleep(0.5)
        await engine.add_adapter("cold", str(cold_dir))
        async for _ in engine.generate([5] * 32, SamplingParams(max_tokens=4), adapter="cold"):
            pass

    task = asyncio.create_task(late())
    r = await run_batch(engine, batch, used, args.ctx, args.steps * 4, seed=3)
    await task
    during = [e.seconds for e in r["log"] if e.decode and e.rows == batch and e.loading]
    quiet = [e.seconds for e in r["log"] if e.decode and e.rows == batch and not e.loading][3:]
    loads = [v for v in engine.testing.adapters.registry.versions() if v.name == "cold"]
    t = loads[0].timings if loads else {}
    from loraplex.engine.bench.coldload.bandwidth import measure_slot_write

    packed = loads[0].adapter.image if loads and loads[0].adapter is not None else None
    model = engine.testing.executor.model
    slot_gbs = measure_slot_write(model, packed, 10) if packed is not None else float("nan")
    pinned = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        dst.copy_(pinned, non_blocking=True)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(side)
        for _ in range(5):
            dst.copy_(pinned, non_blocking=True)
        e1.record(side)
    torch.cuda.synchronize()
    pinned_gbs = 5 * (256 << 20) / (e0.elapsed_time(e1) / 1e3) / 1e9
    print(
        f"cold load stages: { {k: round(v * 1e3, 2) for k, v in t.items() if isinstance(v, float) and v < 100} }"
    )
    rows.append({
        "coldload": True, "steps_with_load": len(during), "p50_with_ms": statistics.median(during) * 1e3 if during else float("nan"),
        "p99_with_ms": pct(during, 0.99) * 1e3 if during else float("nan"), "p50_without_ms": statistics.median(quiet) * 1e3,
        "p99_without_ms": pct(quiet, 0.99) * 1e3, "h2d_ms": t.get("h2d", float("nan")) * 1e3,
        "slot_write_gbs": slot_gbs, "pinned_h2d_gbs": pinned_gbs,
    })  # fmt: skip
    print(rows[-1], flush=True)


async def profile(engine, names, args) -> None:
    """Eager (no graph) decode steps at batch 64 under the torch profiler: top GPU kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner = engine.testing.executor.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            await run_batch(engine, 64, names[: min(len(names), 64)], args.ctx, 6, seed=5)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
    finally:
        runner.graphs = graphs


def hf_peer(args, adapters: list[Path], rows: list[dict]) -> None:
    import peft
    import transformers

    hf_cfg = {k: v for k, v in LLAMA3_8B.items() if k != "model_type"}
    config = transformers.LlamaConfig(**hf_cfg)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="a0")
    for i in range(1, 8):
        model.load_adapter(str(adapters[i]), adapter_name=f"a{i}")
    model.eval()
    for batch in (8, 32):
        names = [f"a{i % 8}" for i in range(batch)]
        ids = torch.randint(1000, 100000, (batch, 128), device="cuda")
        for new in (4, 64):  # the first is a short warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True, adapter_names=names)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(new - 1):
                    out = model(
                        input_ids=nxt, past_key_values=past, use_cache=True, adapter_names=names
                    )
                    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rows.append({"hf": True, "batch": batch, "adapters": 8, "tok_s": batch * 64 / wall})
        print(rows[-1], flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def fmt_row(r: dict) -> str:
    return (
        f"| {r.get('weights', 'bf16')} | {r['adapters']} | {r['batch']} | {'on' if r['pipelined'] else 'off'} | {r['floor_ms']:.2f} | {r['p50_ms']:.2f} | "
        f"{r['p99_ms']:.2f} | {r['gpu_ms']:.2f} | {r['ratio']:.2f} | {r['decode_tok_s']:.0f} | "
        f"{r['e2e_tok_s']:.0f} |"
    )


HEADER = (
    "| weights | adapters | batch | pipelined | floor ms | p50 ms | p99 ms | graph GPU ms | p50/floor "
    "| decode tok/s | e2e tok/s |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 8, 32])
    ap.add_argument(
        "--quantization", nargs="+", default=["none"],
        choices=["none", "fp8", "fp8-w8a16", "fp8-w8a8"],
        help="base weights: none (bf16) and/or fp8 (quantized at start-up; W8A8 per projection "
        "as the engine's default picks it; fp8-w8a16: weight-only at every size; fp8-w8a8: "
        "activations quantized per token from --w8a8-min-tokens tokens on), each a run",
    )  # fmt: skip
    ap.add_argument(
        "--w8a8-min-tokens", type=int, default=3,
        help="fp8-w8a8 runs: steps of at least this many tokens run W8A8 (default 3: every "
        "step past the 1-2-token GEMV)",
    )  # fmt: skip
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-gb", type=int, default=24)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--coldload", action="store_true")
    ap.add_argument("--profile", action="store_true", help="torch profiler table of eager decode")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--append", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, few cases")
    ap.add_argument("--commit", default=None, help="commit to report (copies without git)")
    ap.add_argument("--dump-steps", action="store_true", help="print the slowest steps")
    ap.add_argument(
        "--sync-too", action="store_true", help="also run without pipelined decode (A/B)"
    )
    args = ap.parse_args()
    args.cfg, args.device = LLAMA3_8B, "cuda"
    args.modes = [True, False] if args.sync_too else [True]
    if args.smoke:
        args.cfg = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        args.device, args.no_hf, args.kv_gb = "cpu", True, 1
        args.adapters, args.batches, args.ctx, args.steps = [0, 2], [1, 4], 16, 16
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="loraplex-bench-")
    work = Path(args.workdir)
    model_dir = write_model_config(work / "model", args.cfg)
    n_adapters = max([*args.adapters, 8 if not args.no_hf else 0])
    t0 = time.perf_counter()
    adapters = [write_adapter(work / f"a{i}", args.cfg, rank=16, seed=i) for i in range(n_adapters)]
    if adapters:
        args.adapter_bytes = (adapters[0] / "adapter_model.safetensors").stat().st_size
    else:
        args.adapter_bytes = 0
    print(f"wrote {n_adapters} adapters in {time.perf_counter() - t0:.1f}s", flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []
    if not args.no_hf:
        hf_peer(args, adapters, rows)
    print(HEADER)
    asyncio.run(engine_cases(args, bw, adapters, model_dir, rows))
    table = report(rows, bw, args.commit)
    print(table)
    if args.append:
        with open(args.append, "a") as f:
            f.write(table)


def report(rows: list[dict], bw: float, commit: str | None = None) -> str:
    commit = commit or git_commit()  # LORAPLEX_COMMIT names a copy without .git
    lines = [
        f"\n## Engine decode: {time.strftime('%Y-%m-%d %H:%M')}, commit {commit or 'unknown'}, "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
        f"copy {bw / 1e12:.2f} TB/s\n",
        HEADER,
    ]
    lines += [fmt_row(r) for r in rows if "floor_ms" in r]
    bf16 = {
        (r["adapters"], r["batch"], r["pipelined"]): r["p50_ms"]
        for r in rows
        if r.get("weights", "bf16") == "bf16" and "p50_ms" in r
    }
    fp8 = [r for r in rows if r.get("weights", "").startswith("fp8") and "p50_ms" in r]
    if fp8 and bf16:
        lines.append("\nfp8 base against bf16 (p50 step, same adapters / batch / pipelining):\n")
        lines.append(
            "| weights | adapters | batch | pipelined | fp8 / bf16 | fp8 p50 / fp8 floor |"
        )
        lines.append("|---|---:|---:|---|---:|---:|")
        for r in fp8:
            ref = bf16.get((r["adapters"], r["batch"], r["pipelined"]))
            if ref:
                lines.append(
                    f"| {r['weights']} | {r['adapters']} | {r['batch']} | "
                    f"{'on' if r['pipelined'] else 'off'} | {r['p50_ms'] / ref:.2f} | "
                    f"{r['ratio']:.2f} |"
                )
    base = {
        (r.get("weights", "bf16"), r["batch"], r["pipelined"]): r["p50_ms"]
        for r in rows
        if r.get("adapters") == 0 and "p50_ms" in r
    }
    lines.append("\nLoRA overhead against base-only decode (p50, same pipelining):\n")
    lines.append("| weights | adapters | batch | pipelined | overhead |")
    lines.append("|---|---:|---:|---|---:|")
    for r in rows:
        key = (r.get("weights", "bf16"), r.get("batch"), r.get("pipelined"))
        if r.get("adapters") and "p50_ms" in r and key in base:
            lines.append(
                f"| {key[0]} | {r['adapters']} | {r['batch']} | {'on' if r['pipelined'] else 'off'} | "
                f"{100 * (r['p50_ms'] / base[key] - 1):+.1f} % |"
            )
    for r in rows:
        if r.get("hf"):
            ours = [x for x in rows if x.get("hf_workload") and x["batch"] == r["batch"]]
            mine = (
                f"{ours[0]['tok_s']:.0f} tok/s ({ours[0]['tok_s'] / r['tok_s']:.1f}x)"
                if ours
                else "-"
            )
            lines.append(
                f"\nctx 128 + 64 new, batch {r['batch']}, 8 adapters: HF PEFT {r['tok_s']:.0f} tok/s; "
                f"loraplex {mine}"
            )
        if r.get("coldload"):
            lines.append(f"\nCold load during batch-64 decode: {r}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
