"""Prompt-lookup speculation on a real checkpoint: a workload whose answers quote the prompt.

    python -m benchmarks.spec_quoting                  # SmolLM2-135M-Instruct on the CPU (~5 min)
    python -m benchmarks.spec_quoting --append BENCHMARKS.md
    python -m benchmarks.spec_quoting --smoke          # tiny random model: checks the script

The model is SmolLM2-135M-Instruct (``benchmarks.checkpoints``, float32), served with one LoRA
adapter trained on it here (rank 8 on q/k/v/o, a short run of supervised steps on a synthetic
extraction task: "copy the line that mentions X from this record", cached next to the
checkpoint). Requests ask the same kind of question of unseen records, half through the
adapter and half on the base model, at batch 1, greedy. The same requests run with
``speculative_method="ngram"`` (K = 4) and without, alternating, in one process; the table
gives tokens/s of each, the acceptance rate and the mean accepted length per verify step (from
the engine's ``speculative`` stats), per adapter. Greedy outputs must be identical with and
without speculation; the script exits non-zero if they are not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.checkpoints import DEFAULT_CACHE, cpu_model_dir
from benchmarks.record import git_commit
from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams

K = 4
_NOUNS = [
    "river",
    "lantern",
    "copper",
    "orchard",
    "violin",
    "harbor",
    "meadow",
    "glacier",
    "comet",
    "falcon",
    "ember",
    "tundra",
]
_VERBS = [
    "carries",
    "holds",
    "guards",
    "paints",
    "follows",
    "measures",
    "gathers",
    "crosses",
    "shelters",
    "lifts",
]
_ADJS = [
    "quiet",
    "amber",
    "distant",
    "narrow",
    "ancient",
    "bright",
    "hollow",
    "gentle",
    "rapid",
    "silver",
]


def _line(rng: random.Random, key: str) -> str:
    words = [rng.choice(_ADJS), key, rng.choice(_VERBS), "the", rng.choice(_ADJS)]
    words += [rng.choice(_NOUNS), "near", "the", rng.choice(_NOUNS), f"at {rng.randint(1, 99)}"]
    return " ".join(words) + "."


def record_task(rng: random.Random) -> tuple[str, str]:
    """(prompt, answer): a record of five lines, the answer is the line naming one key."""
    keys = rng.sample(_NOUNS, 5)
    lines = [f"{i + 1}. The {_line(rng, k)}" for i, k in enumerate(keys)]
    pick = rng.randrange(5)
    prompt = (
        "Record:\n" + "\n".join(lines) + f"\n\nCopy the line that mentions the {keys[pick]}, "
        "word for word, then explain in one sentence what it says."
    )
    return prompt, lines[pick][3:]


class Codec:
    """Text -> token ids: the checkpoint's tokenizer with its chat template; a tiny random model
    without a tokenizer (``--smoke``) gets characters folded into its vocabulary."""

    def __init__(self, model_dir: Path) -> None:
        import transformers

        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError):
            self.tok = None
            self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def prompt(self, text: str) -> list[int]:
        if self.tok is None:
            return [3 + ord(c) % (self.vocab - 3) for c in text[:48]]
        return list(
            self.tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True,
                return_dict=False,
            )
        )  # fmt: skip

    def answer(self, text: str) -> list[int]:
        if self.tok is None:
            return [3 + ord(c) % (self.vocab - 3) for c in text[:16]]
        return self.tok(text + self.tok.eos_token, add_special_tokens=False)["input_ids"]


def train_adapter(model_dir: Path, out: Path, steps: int, seed: int = 0) -> Path:
    """A rank-8 q/k/v/o LoRA fine-tuned on the extraction task (cached by folder)."""
    if (out / "adapter_model.safetensors").exists():
        return out
    import peft
    import transformers

    torch.manual_seed(seed)
    codec = Codec(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    model = peft.get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(4):
            prompt, answer = record_task(rng)
            p, a = codec.prompt(prompt), codec.answer(answer)
            ids.append(p + a)
            labels.append([-100] * len(p) + a)
        n = max(map(len, ids))
        pad = 0
        x = torch.tensor([s + [pad] * (n - len(s)) for s in ids])
        y = torch.tensor([s + [-100] * (n - len(s)) for s in labels])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in ids])
        loss = model(input_ids=x, attention_mask=mask, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out, safe_serialization=True)
    return out


async def _run(
    engine: AsyncEngine, prompts: list[tuple[list[int], str | None]], max_tokens: int
) -> tuple[list[list[int]], dict[str, float]]:
    """Greedy outputs after the first token, and decode tokens/s per adapter group (after each
    request's first token; "(base)" for the base model)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs: list[list[int]] = []
    tokens: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for prompt, adapter in prompts:  # batch 1: one request at a time
        group = adapter or "(base)"
        ids: list[int] = []
        first = None
        async for o in engine.generate(prompt, params, adapter=adapter):
            if first is None:  # decode only: the prompt's prefill is the same either way
                first = time.perf_counter()
                ids.extend(o.token_ids[1:])
            else:
                ids.extend(o.token_ids)
        if first is not None:
            seconds[group] = seconds.get(group, 0.0) + time.perf_counter() - first
        tokens[group] = tokens.get(group, 0) + len(ids)
        outs.append(ids)
    return outs, {g: tokens[g] / seconds[g] for g in tokens if seconds.get(g)}


async def main(args: argparse.Namespace) -> str:
    tmp = tempfile.mkdtemp(prefix="spec_quoting_")
    model_dir = cpu_model_dir(args.smoke, args.model_dir, tmp)
    cache = Path(tmp) if args.smoke else DEFAULT_CACHE
    adapter = train_adapter(
        model_dir, cache / "smollm2-quoting-lora", 2 if args.smoke else args.steps
    )
    codec = Codec(model_dir)
    rng = random.Random(1234)
    prompts = []
    for i in range(args.requests):
        prompt, _ = record_task(rng)
        prompts.append((codec.prompt(prompt), "quote" if i % 2 == 0 else None))
    results: dict[str, dict] = {}
    configs = {"off": None, "ngram": "ngram"}
    outputs: dict[str, list] = {}
    for rnd in range(args.rounds):
        order = list(configs) if rnd % 2 == 0 else list(configs)[::-1]
        for name in order:
            cfg = EngineConfig(
                model=str(model_dir),
                dtype="float32",
                speculative_method=configs[name],
                num_speculative_tokens=K,
                max_lora_rank=8,
                seed=0,
            )
            async with AsyncEngine(cfg) as engine:
                await engine.add_adapter("quote", str(adapter))
                await _run(engine, prompts[:1], 4)  # warm-up
                before = engine.stats().get("speculative")
                outs, tps = await _run(engine, prompts, args.max_tokens)
                after = engine.stats().get("speculative")
            outputs.setdefault(name, outs)
            if outputs[name] != outs:
                raise SystemExit(f"{name}: greedy outputs changed between rounds")
            r = results.setdefault(name, {"tps": {}})
            for group, v in tps.items():
                r["tps"].setdefault(group, []).append(v)
            if after is not None:
                r["spec"] = _delta(before, after)
    if outputs["off"] != outputs["ngram"]:
        raise SystemExit("greedy outputs differ with and without speculation")
    return _table(results, args, model_dir)


def _delta(before: dict | None, after: dict) -> dict[str, dict[str, float]]:
    out = {}
    for name, a in after.get("per_adapter", {}).items():
        b = (before or {}).get("per_adapter", {}).get(name, {})
        prev = b.get("acceptance_lengths", [])
        hist = [
            x - (prev[i] if i < len(prev) else 0) for i, x in enumerate(a["acceptance_lengths"])
        ]
        rows = sum(hist)
        acc = a["accepted_tokens"] - b.get("accepted_tokens", 0)
        prop = a["proposed_tokens"] - b.get("proposed_tokens", 0)
        out[name or "(base)"] = {
            "rate": acc / prop if prop else 0.0,
            "mean_len": sum(i * h for i, h in enumerate(hist)) / rows if rows else 0.0,
            "rows": rows,
        }
    return out


def _table(results: dict, args: argparse.Namespace, model_dir: Path) -> str:
    spec = results["ngram"].get("spec", {})
    lines = [
        f"\n### Prompt lookup on a quoting workload ({time.strftime('%Y-%m-%d')}, commit "
        f"{git_commit()}, CPU {os.cpu_count()} cores, {model_dir.name})\n",
        f"`python -m benchmarks.spec_quoting --requests {args.requests} --max-tokens "
        f"{args.max_tokens} --rounds {args.rounds}`; batch 1, greedy, K = {K}, half the requests "
        "through the adapter trained to quote; outputs identical with and without speculation.\n",
        "Decode tokens/s: the tokens after each request's first over the time after it.\n",
        "| requests | tokens/s off | tokens/s ngram | x off | acceptance rate "
        "| accepted per verify step | verify steps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for group in sorted(results["off"]["tps"]):
        off = statistics.median(results["off"]["tps"][group])
        on = statistics.median(results["ngram"]["tps"].get(group, [0.0]))
        s = spec.get(group, {"rate": 0.0, "mean_len": 0.0, "rows": 0})
        lines.append(
            f"| {group} | {off:.1f} | {on:.1f} | {on / off:.2f} | {s['rate']:.2f} "
            f"| {s['mean_len']:.2f} | {s['rows']} |"
        )
    return "\n".join(lines) + "\n"


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60, help="training steps of the adapter")
    ap.add_argument("--append", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.max_tokens, args.rounds = 2, 8, 1
    table = asyncio.run(main(args))
    print(table)
    if args.append is not None:
        with args.append.open("a") as f:
            f.write(table)
    print(json.dumps({"ok": True}))


if __name__ == "__main__":
    cli()
