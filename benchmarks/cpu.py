"""CPU decode: loraplex's AsyncEngine against HF transformers ``generate`` (+ PEFT), interleaved.

    python -m benchmarks.cpu                         # the table (~10 min on 2 cores)
    python -m benchmarks.cpu --append BENCHMARKS.md  # ... and append it with date and commit
    python -m benchmarks.cpu --smoke                 # tiny random model: checks the script
    python -m benchmarks.cpu --profile               # op table of one batch-8 adapter run

Model: SmolLM2-135M-Instruct de-quantized to float32 (benchmarks/checkpoints.py builds it
once). Adapters: rank 8, alpha 16, on q/v/o/down, made with peft with random A and B.
Workload: 64-token prompts (random ids, fresh each run so no prefix-cache hit), 64 greedy
tokens each (EOS ignored), batches of 1 and 8; "four" = a batch of 8 over 4 adapters (HF:
``adapter_names``). HF and loraplex run alternately in one process, ``--repeats`` times;
tok/s = generated tokens / wall time of the whole batch (prefill included), median over
repeats; both use ``--threads`` torch threads. Host overhead per step = engine wall time not
spent in the model runner's ``execute`` (scheduling, inputs, sampling, streaming, the asyncio
loop) / steps.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from benchmarks.checkpoints import cpu_model_dir
from benchmarks.record import append_cpu_record
from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams

CASES = [(1, "none"), (1, "one"), (8, "none"), (8, "one"), (8, "four")]
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, n: int, rank: int) -> list[Path]:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = []
    for i in range(n):
        cfg = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False
        )
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(base, cfg)  # random A and B (B non-zero)
        paths.append(out / f"a{i}")
        model.save_pretrained(paths[-1], safe_serialization=True)
        base = model.unload()
    return paths


class HF:
    """Plain transformers for "none", the same weights wrapped by PEFT for adapters."""

    def __init__(self, model_dir: Path, adapters: list[Path]) -> None:
        import peft
        import transformers

        load = transformers.AutoModelForCausalLM.from_pretrained
        self.plain = load(model_dir, dtype=torch.float32).eval()
        peft_model = peft.PeftModel.from_pretrained(
            load(model_dir, dtype=torch.float32), adapters[0], adapter_name="a0"
        )
        for i, path in enumerate(adapters[1:], start=1):
            peft_model.load_adapter(path, adapter_name=f"a{i}")
        self.peft = peft_model.eval()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], names: list[str | None], new: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        kw: dict[str, Any] = dict(
            max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )  # fmt: skip
        if names[0] is None:
            out = self.plain.generate(ids, **kw)
        elif len(set(names)) == 1:
            self.peft.set_adapter(names[0])
            out = self.peft.generate(input_ids=ids, **kw)
        else:
            out = self.peft.generate(input_ids=ids, adapter_names=names, **kw)
        return out[:, ids.shape[1] :].tolist()


class Timed:
    """Wraps the model runner's ``execute``: seconds per call."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.inner, self.calls = runner, runner.execute, []
        runner.execute = self

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(*a, **kw)
        self.calls.append(time.perf_counter() - t0)
        return out


async def ours(engine: AsyncEngine, prompts, names, new: int) -> tuple[list[list[int]], dict]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    timed: Timed = engine.testing.executor.runner.execute
    timed.calls.clear()

    async def one(i: int) -> list[int]:
        toks: list[int] = []
        async for out in engine.generate(prompts[i], params, adapter=names[i]):
            toks += out.token_ids
        return toks

    t0 = time.perf_counter()
    toks = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    steps = len(timed.calls)
    return toks, {"wall": wall, "forward": sum(timed.calls), "steps": steps}


def names_for(kind: str, batch: int) -> list[str | None]:
    if kind == "none":
        return [None] * batch
    if kind == "one":
        return ["a0"] * batch
    return [f"a{i % 4}" for i in range(batch)]


async def bench(args) -> list[dict]:
    model_dir, adapters = args.model_dir, args.adapters
    hf = HF(model_dir, adapters)
    cfg = EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", max_loras=4, max_cpu_loras=4,
        max_lora_rank=args.rank, max_num_seqs=8, cpu_threads=args.threads,
    )  # fmt: skip
    vocab = hf.plain.config.vocab_size
    results: dict[tuple[int, str], dict[str, list]] = {}
    async with AsyncEngine(cfg) as engine:
        for i, path in enumerate(adapters):
            await engine.add_adapter(f"a{i}", str(path))
        Timed(engine.testing.executor.runner)
        g = random.Random(0)
        for rep in range(args.repeats + 1):  # repeat 0 warms both up and is not counted
            for batch, kind in args.cases:
                names = names_for(kind, batch)
                prompts = [[g.randrange(100, vocab) for _ in range(args.prompt)] for _ in names]
                order = ["hf", "ours"] if rep % 2 else ["ours", "hf"]
                r = results.setdefault((batch, kind), {"hf": [], "ours": [], "o": [], "same": []})
                toks = {}
                for who in order:
                    if who == "hf":
                        t0 = time.perf_counter()
                        toks["hf"] = hf.run(prompts, names, args.new)
                        wall = time.perf_counter() - t0
                    else:
                        toks["ours"], info = await ours(engine, prompts, names, args.new)
                        wall = info["wall"]
                        over = (info["wall"] - info["forward"]) / max(info["steps"], 1)
                    tok_s = batch * args.new / wall
                    if rep:
                        r[who].append(tok_s)
                if rep:
                    r["o"].append(over)
                    r["same"].append(
                        sum(a == b for a, b in zip(toks["hf"], toks["ours"], strict=True))
                    )
                print(
                    f"rep {rep} batch {batch} {kind}: hf {r['hf'][-1] if rep else 0:.1f} "
                    f"ours {r['ours'][-1] if rep else 0:.1f} tok/s",
                    flush=True,
                )
    rows = []
    for (batch, kind), r in results.items():
        hf_med, ours_med = statistics.median(r["hf"]), statistics.median(r["ours"])
        rows.append({
            "batch": batch, "adapter": kind, "hf": hf_med, "ours": ours_med,
            "ratio": ours_med / hf_med,
            "ratios": [o / h for o, h in zip(r["ours"], r["hf"], strict=True)],
            "overhead_ms": statistics.median(r["o"]) * 1e3,
            "same": f"{sum(r['same'])}/{batch * len(r['same'])}",
        })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| batch | adapter | HF `generate` (+ PEFT) tok/s | loraplex tok/s | ratio | "
        "host overhead / step | same greedy tokens |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kind = "4 adapters (HF: `adapter_names`)" if r["adapter"] == "four" else r["adapter"]
        lines.append(
            f"| {r['batch']} | {kind} | {r['hf']:.1f} | {r['ours']:.1f} | **{r['ratio']:.2f}** | "
            f"{r['overhead_ms']:.2f} ms | {r['same']} |"
        )
    hf8 = [r["hf"] for r in rows if r["batch"] == 8 and r["adapter"] == "one"]
    four = [r["ours"] for r in rows if r["batch"] == 8 and r["adapter"] == "four"]
    if hf8 and four:
        lines.append(
            f"\nbatch 8 over 4 adapters against HF's single-adapter batch-8 figure: "
            f"{four[0] / hf8[0]:.2f} x"
        )
    return "\n".join(lines)


def profile(args) -> None:
    from torch.profiler import profile as torch_profile

    async def run() -> None:
        cfg = EngineConfig(
            model=str(args.model_dir), device="cpu", dtype="float32", max_loras=4,
            max_cpu_loras=4, max_lora_rank=args.rank, max_num_seqs=8, cpu_threads=args.threads,
        )  # fmt: skip
        async with AsyncEngine(cfg) as engine:
            for i, path in enumerate(args.adapters):
                await engine.add_adapter(f"a{i}", str(path))
            Timed(engine.testing.executor.runner)
            names = names_for(args.profile_kind, 8)
            prompts = [[100 + i] * args.prompt for i in range(8)]
            await ours(engine, prompts, names, 8)
            with torch_profile() as prof:
                await ours(engine, [[200 + i] * args.prompt for i in range(8)], names, args.new)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))

    asyncio.run(run())


def _cases(text: str) -> list[tuple[int, str]]:
    out = []
    for part in text.split(","):
        batch, kind = part.split(":")
        if kind not in ("none", "one", "four"):
            raise argparse.ArgumentTypeError(f"adapter kind {kind!r}: none, one or four")
        out.append((int(batch), kind))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    # NOTE: one count for both (set process-wide); default: the engine's, one core fewer
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1))
    ap.add_argument("--model-dir", type=Path, help="default: SmolLM2-135M-Instruct f32 (cached)")
    ap.add_argument("--cases", type=_cases, default=CASES, help="e.g. 1:none,8:four")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 1 repeat")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-kind", default="four", choices=["none", "one", "four"])
    ap.add_argument("--append", type=Path, help="append the table to this markdown file")
    ap.add_argument("--note", default="", help="a line added under the table (e.g. 'shared')")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = cpu_model_dir(args.smoke, args.model_dir, tmp)
        if args.smoke:
            args.repeats, args.prompt, args.new = 1, 8, 4
        args.adapters = make_adapters(args.model_dir, Path(tmp), 4, args.rank)
        if args.profile:
            profile(args)
            return
        rows = asyncio.run(bench(args))
    text = table(rows)
    print(text)
    if args.append:
        command = f"python -m benchmarks.cpu --repeats {args.repeats}"
        append_cpu_record(args.append, command, text, args.threads, args.note)


if __name__ == "__main__":
    main()
