"""fp8 base quality on a real checkpoint (issue 15): fp8 against float32, with and without LoRA.

    python -m benchmarks.fp8_quality                         # the table (~2 min on 2 cores)
    python -m benchmarks.fp8_quality --append BENCHMARKS.md  # ... appended with date and commit
    python -m benchmarks.fp8_quality --smoke                 # tiny random model: the script

Model: SmolLM2-135M-Instruct de-quantized to float32 (benchmarks/checkpoints.py). The fp8
model is the same checkpoint loaded with ``quantization="fp8"`` (every projection quantized
per output channel to e4m3, computed de-quantized in float32: the CPU path); a bfloat16 load
of the float32 checkpoint is the yardstick. "fp8 W8A8": the same fp8 weights with the
activations of every projection quantized per token to e4m3 (``fp8_w8a8_min_tokens``: the
GPU's W8A8 path, here through its torch twins). Adapter: one rank-8 PEFT adapter (alpha 16,
q/v/o/down, random A and B; ``benchmarks.cpu.make_adapters``).

16 fixed chat prompts (the model's chat template), one batch, run through the model runner
the engine uses on CPU. The reference (float32, the same adapter or none) decodes 32 greedy
tokens; the other model then reads the reference's tokens (teacher forcing) and is compared
at each of the 32 positions: mean / max KL(reference || other) of the next-token
distributions, and top-1 agreement (its argmax is the reference's token). Free-running, the
other model also decodes its own 32 greedy tokens: "same 32" counts prompts whose 32 tokens
all equal the reference's, "first split" is the mean position of the first different token
(32 when none differs).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from benchmarks.checkpoints import cpu_model_dir
from benchmarks.record import append_cpu_record
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.slot_buffers import write_slot
from loraplex.engine.model.quant import drop_float_bases, fp8_layers
from loraplex.engine.model_runner import ModelRunner, StepItem

__all__ = ["PROMPTS", "NEW", "prompt_ids", "decode", "compare", "measure", "table"]

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 20.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "What are the benefits of regular exercise?",
    "Write a SQL query that counts rows in a table named users.",
    "Who wrote 'Pride and Prejudice'?",
    "Suggest a name for a small coffee shop.",
]
NEW = 32
BLOCK = 16


def prompt_ids(model_dir: Path, prompts: list[str] = PROMPTS) -> list[list[int]]:
    """Each prompt as one user turn in the model's chat template (random ids without one)."""
    from loraplex.engine.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_dir(model_dir)
    except TokenizerError:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, 250, (8 + i,), generator=g).tolist() for i in range(16)]
    out = []
    for text in prompts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}])
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


@dataclass
class Decoded:
    tokens: list[list[int]]  # (NEW, B): the tokens fed / chosen at each step
    argmax: list[list[int]]  # (NEW, B): the model's own greedy choice at each step
    logprobs: list[torch.Tensor]  # NEW x (B, V) float32


def runner_for(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    quantization: str | None,
    adapter: Path | None,
    rank: int,
    blocks: int,
) -> ModelRunner:
    w8a8 = quantization == W8A8_QUANT
    model = load_model(model_dir, dtype=dtype, device="cpu", max_loras=1, max_lora_rank=rank,
                       quantization="fp8" if w8a8 else quantization)  # fmt: skip
    if w8a8:  # the GPU's W8A8 path through its twins: float rows dropped, every step W8A8
        drop_float_bases(model)
        for lin in fp8_layers(model):
            lin.w8a8_min_tokens = 1
    runner = ModelRunner(model, num_blocks=blocks, block_size=BLOCK, use_cuda_graphs=False,
                         kernel_backend="torch")  # fmt: skip
    if adapter is not None:
        lora = load_adapter(adapter, model.cfg, max_lora_rank=rank, name="a0", dtype=dtype)
        write_slot(model, 0, lora)
        runner.slot_ranks.set(0, lora.rank)
    return runner


@torch.inference_mode()
def decode(
    runner: ModelRunner,
    prompts: list[list[int]],
    new: int,
    *,
    slot: int,
    force: list[list[int]] | None = None,
) -> Decoded:
    """Prefill all prompts in one step, then ``new - 1`` decode steps; ``force``: feed these
    tokens (per step, per row) instead of the model's own greedy ones."""
    tables, nxt = [], 0
    for p in prompts:
        need = -(-(len(p) + new) // BLOCK)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    items = [StepItem(list(p), 0, tables[i], slot) for i, p in enumerate(prompts)]
    out = Decoded([], [], [])
    for step in range(new):
        logits = runner.execute(items).float()
        out.logprobs.append(logits.log_softmax(-1))
        own = logits.argmax(-1).tolist()
        out.argmax.append(own)
        fed = force[step] if force is not None else own
        out.tokens.append(fed)
        items = [StepItem([fed[i]], len(p) + step, tables[i], slot) for i, p in enumerate(prompts)]
    return out


def compare(ref: Decoded, forced: Decoded, free: Decoded) -> dict:
    """KL and top-1 agreement under teacher forcing; sequence agreement free-running."""
    kl = torch.stack(
        [(a.exp() * (a - b)).sum(-1) for a, b in zip(ref.logprobs, forced.logprobs, strict=True)]
    )  # (NEW, B)
    ref_t = torch.tensor(ref.tokens)
    top1 = (torch.tensor(forced.argmax) == ref_t).float().mean().item()
    differs = torch.tensor(free.tokens) != ref_t  # (NEW, B)
    new, rows = differs.shape
    first = [int(differs[:, b].nonzero()[0]) if differs[:, b].any() else new for b in range(rows)]
    return {
        "kl_mean": kl.clamp(min=0).mean().item(),
        "kl_max": kl.max().item(),
        "top1": top1,
        "same": sum(f == new for f in first),
        "rows": rows,
        "new": new,
        "first_split": sum(first) / rows,
    }


FP8 = "fp8 (e4m3, per channel)"
W8A8 = "fp8 W8A8 (+ e4m3 activations, per token)"
W8A8_QUANT = "fp8-w8a8"  # runner_for: fp8 weights, activations quantized per token
BF16 = "bfloat16 (yardstick)"


def measure(
    model_dir: Path,
    adapter: Path,
    *,
    rank: int = 8,
    new: int = NEW,
    prompts: list[list[int]] | None = None,
    yardstick: bool = True,
    w8a8: bool = True,
) -> list[dict]:
    """The table's rows: fp8 (W8A8, bfloat16) against float32, base and with the adapter."""
    prompts = prompts or prompt_ids(model_dir)
    blocks = sum(-(-(len(p) + new) // BLOCK) for p in prompts)
    kw = dict(rank=rank, blocks=blocks)
    others = [(FP8, torch.float32, "fp8")]
    others += [(W8A8, torch.float32, W8A8_QUANT)] if w8a8 else []
    others += [(BF16, torch.bfloat16, None)] if yardstick else []
    rows = []
    for name, path in (("none", None), (f"rank-{rank} adapter", adapter)):
        slot = -1 if path is None else 0
        ref = decode(runner_for(model_dir, dtype=torch.float32, quantization=None,
                                adapter=path, **kw), prompts, new, slot=slot)  # fmt: skip
        for label, dtype, quant in others:
            runner = runner_for(model_dir, dtype=dtype, quantization=quant, adapter=path, **kw)
            forced = decode(runner, prompts, new, slot=slot, force=ref.tokens)
            free = decode(runner, prompts, new, slot=slot)
            rows.append({"base": label, "adapter": name, **compare(ref, forced, free)})
            print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model vs float32 | adapter | mean KL (nats) | max KL | top-1 agreement (forced) | "
        f"same {rows[0]['new']} greedy tokens | first split (mean) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['base']} | {r['adapter']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
            f"{100 * r['top1']:.1f} % | {r['same']}/{r['rows']} | {r['first_split']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, help="default: SmolLM2-135M-Instruct f32 (cached)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--new", type=int, default=NEW)
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1))
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 4 tokens")
    ap.add_argument("--append", type=Path, help="append the table to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = cpu_model_dir(args.smoke, args.model_dir, tmp)
        if args.smoke:
            args.new = 4
        from benchmarks.cpu import make_adapters

        (adapter,) = make_adapters(args.model_dir, Path(tmp), 1, args.rank)
        rows = measure(args.model_dir, adapter, rank=args.rank, new=args.new)
    text = table(rows)
    print(text)
    if args.append:
        append_cpu_record(args.append, "python -m benchmarks.fp8_quality", text, args.threads)


if __name__ == "__main__":
    main()
