"""Structured output: decode steps with half the batch under a JSON schema, and grammar
compile / mask times (issue 20).

    python -m benchmarks.structured                                # on a GPU (H200), minutes
    python -m benchmarks.structured --append BENCHMARKS.md
    python -m benchmarks.structured --smoke                        # tiny model on CPU
    python -m benchmarks.structured --compile-only --tokenizer DIR [--xgrammar]   # CPU
    python -m benchmarks.structured --cpu-masks                    # mask fill, CPU

Decode: random bf16 weights of the Llama-3-8B shape and a synthetic byte-level BPE tokenizer
of its vocabulary size (128 256 tokens, built here from random merges of JSON-ish characters:
nothing is downloaded). ``--batch`` requests with ~``--ctx``-token prompts decode ``--steps``
tokens together, pipelined, twice: all free, then half of them under a JSON schema that cannot
end inside the window (an array of at least 1000 short strings), so every step masks half the
rows. A step is the time between two consecutive steps' tokens reaching the host
(``StepRecord.seconds``); p50 / p99 over full-batch decode steps, and the host time to fill the
masks (``fill_masks``) per step.

Compile: every test schema and form of ``tests/structured/forms.py``, compiled cold
``--repeats`` times each with the given tokenizer (default: the synthetic one): p50 / p99, and
the per-token mask time along a valid output. ``--xgrammar`` times xgrammar the same way when
it is installed (the comparison behind choosing llguidance, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.record import git_commit
from benchmarks.synthetic import LLAMA3_8B, random_model, write_model_config
from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams, StructuredOutput
from loraplex.engine.structured import bitmask
from loraplex.engine.structured.grammars import GrammarCache, grammar_text
from tests.structured.forms import ARRAY, CHOICES, ENUM, LONG, NESTED, REGEX

TINY = {
    **LLAMA3_8B,
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": 4094,
    "eos_token_id": 4095,
    "torch_dtype": "float32",
}
# form -> (constraint, a valid output written with the engine's separators)
FORMS = {
    "nested": (
        StructuredOutput.json_schema(NESTED),
        '{"name": "Ann", "address": {"street": "Main St", "zip": "12345"}, "age": 33}',
    ),
    "enum": (StructuredOutput.json_schema(ENUM), '{"color": "red", "size": "M", "in_stock": true}'),
    "array": (StructuredOutput.json_schema(ARRAY), '{"tags": ["a", "bc"], "scores": [1, 20]}'),
    "json_object": (StructuredOutput.json_object(), '{"a": [1, {"b": null}], "c": "d"}'),
    "regex": (StructuredOutput.regex(REGEX), "abc-123"),
    "choice": (StructuredOutput.choice(CHOICES), "neutral"),
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- a synthetic tokenizer ------------------------------------------------------------------------


def _byte_chars() -> dict[int, str]:
    """Byte -> printable character, the byte-level BPE convention (printable bytes map to
    themselves, the rest to code points from 256 up)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def write_synthetic_tokenizer(folder: Path, vocab_size: int, bos: int, eos: int) -> None:
    """A byte-level BPE ``tokenizer.json`` of ``vocab_size`` tokens: 256 bytes, random merges of
    letters / digits / JSON punctuation / space up to 12 characters, specials at the top."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    alphabet = [chars[b] for b in b' "{}[]:,.-_0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ\n']
    rng = random.Random(0)
    n_special = vocab_size - min(bos, eos)
    pieces, merges = list(alphabet), []
    while len(vocab) < vocab_size - n_special:
        a = rng.choice(pieces[: 64 + len(pieces) // 4])  # short, early pieces merge most
        b = rng.choice(alphabet if rng.random() < 0.7 else pieces)
        t = a + b
        if len(t) > 12 or t in vocab:
            continue
        vocab[t] = len(vocab)
        merges.append((a, b))
        pieces.append(t)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = {bos: "<|begin_of_text|>", eos: "<|end_of_text|>"}
    specials = [names.get(i, f"<|reserved_{i}|>") for i in range(len(vocab), vocab_size)]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": names[bos], "eos_token": names[eos], "add_bos_token": True})
    )


# -- decode ---------------------------------------------------------------------------------------


async def decode_case(engine, batch: int, constrained: int, ctx: int, steps: int, seed: int):
    g = random.Random(seed)
    vocab = engine.testing.executor.model.cfg.vocab_size
    prompts = [[g.randrange(vocab // 8, vocab - 512) for _ in range(ctx)] for _ in range(batch)]
    free = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    guided = free.clone(structured=StructuredOutput.json_schema(LONG))
    fills: list[float] = []
    fill = bitmask.fill_masks

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = fill(*a, **k)
        fills.append(time.perf_counter() - t0)
        return out

    import loraplex.engine.executor as executor_module

    executor_module.fill_masks = timed
    engine.testing.step_log.clear()

    async def one(i: int) -> int:
        n = 0
        p = guided if i % 2 and i // 2 < constrained else free
        async for out in engine.generate(prompts[i], p):
            n += len(out.token_ids)
        return n

    try:
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(batch))))
        wall = time.perf_counter() - t0
    finally:
        executor_module.fill_masks = fill
    log = list(engine.testing.step_log)
    full = [e.seconds for e in log if e.decode and e.rows == batch][3:]
    return {"steps": full, "fills": fills, "wall": wall, "tokens": tokens}


async def decode(args, model_dir: Path, rows: list[dict]) -> None:
    model = random_model(args.cfg, max_loras=0, max_lora_rank=16, device=args.device,
                         dtype=args.dtype)  # fmt: skip
    cfg = EngineConfig(
        model=str(model_dir), device=args.device, dtype=str(args.dtype).removeprefix("torch."),
        max_loras=0, max_num_seqs=args.batch, max_num_batched_tokens=16384,
        kv_cache_bytes=args.kv_gb << 30, max_model_len=4096, enable_prefix_caching=False,
    )  # fmt: skip
    async with AsyncEngine(cfg, model=model) as engine:
        # warm: graphs, the grammar cache's tokenizer trie and the schema's compile
        await decode_case(engine, args.batch, args.batch // 2, args.ctx, 8, seed=1)
        for constrained in (0, args.batch // 2):
            r = await decode_case(engine, args.batch, constrained, args.ctx, args.steps, seed=2)
            row = {
                "batch": args.batch,
                "constrained": constrained,
                "p50_ms": statistics.median(r["steps"]) * 1e3,
                "p99_ms": pct(r["steps"], 0.99) * 1e3,
                "fill_p50_ms": statistics.median(r["fills"]) * 1e3 if r["fills"] else 0.0,
                "fill_p99_ms": pct(r["fills"], 0.99) * 1e3 if r["fills"] else 0.0,
                "tok_s": r["tokens"] / r["wall"],
                "n_steps": len(r["steps"]),
                "fill_threads": bitmask.fill_threads(),  # = lanes per constraint
            }
            rows.append(row)
            print(row, flush=True)


# -- compile and mask times -----------------------------------------------------------------------


def llguidance_times(tokenizer_dir: Path, vocab: int, eos: list[int], repeats: int) -> dict:
    from tokenizers import Tokenizer

    text = (tokenizer_dir / "tokenizer.json").read_text()
    cache = GrammarCache(lambda: text, vocab, eos)
    t0 = time.perf_counter()
    cache.tokenizer  # noqa: B018 - built once per engine, timed apart
    out = {"tokenizer_s": time.perf_counter() - t0, "forms": {}}
    tok = Tokenizer.from_str(text)
    words = bitmask.mask_words(vocab)
    for name, (spec, doc) in FORMS.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            m = cache.compile(grammar_text(spec))
            times.append(time.perf_counter() - t0)
        mask = torch.empty((1, words), dtype=torch.int32)
        masks = []
        for t in tok.encode(doc, add_special_tokens=False).ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
            masks.append(time.perf_counter() - t0)
            assert m.consume_token(t), (name, doc, m.get_error())
        out["forms"][name] = (times, masks)
    cache.close()
    return out


def xgrammar_times(tokenizer_dir: Path, vocab: int, repeats: int) -> dict | None:
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        return None
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    out = {"tokenizer_s": time.perf_counter() - t0, "forms": {}}
    for name, (spec, doc) in FORMS.items():
        times = []
        for _ in range(repeats):
            comp = xgr.GrammarCompiler(info, cache_enabled=False)
            t0 = time.perf_counter()
            if spec.kind == "json":
                g = comp.compile_json_schema(spec.value, any_whitespace=False,
                                             separators=(", ", ": "))  # fmt: skip
            elif spec.kind == "json_object":
                g = comp.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             separators=(", ", ": "))  # fmt: skip
            elif spec.kind == "regex":
                g = comp.compile_regex(spec.value)
            else:
                options = json.loads(spec.value)
                g = comp.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in options))
            times.append(time.perf_counter() - t0)
        m = xgr.GrammarMatcher(g)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        masks = []
        for t in hf.encode(doc, add_special_tokens=False):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            masks.append(time.perf_counter() - t0)
            assert m.accept_token(t), (name, doc)
        out["forms"][name] = (times, masks)
    return out


def compile_table(name: str, r: dict) -> str:
    lines = [
        f"{name}: tokenizer set-up {r['tokenizer_s'] * 1e3:.0f} ms (once per engine)",
        "",
        "| form | compile p50 ms | compile p99 ms | mask p50 µs | mask p99 µs |",
        "|---|---|---|---|---|",
    ]
    alls, allm = [], []
    for form, (times, masks) in r["forms"].items():
        alls += times
        allm += masks
        lines.append(
            f"| {form} | {statistics.median(times) * 1e3:.2f} | {pct(times, 0.99) * 1e3:.2f} | "
            f"{statistics.median(masks) * 1e6:.0f} | {pct(masks, 0.99) * 1e6:.0f} |"
        )
    lines.append(
        f"| **all** | {statistics.median(alls) * 1e3:.2f} | {pct(alls, 0.99) * 1e3:.2f} | "
        f"{statistics.median(allm) * 1e6:.0f} | {pct(allm, 0.99) * 1e6:.0f} |"
    )
    return "\n".join(lines)


def decode_table(rows: list[dict]) -> str:
    lines = [
        "| batch | rows under a schema | step p50 ms | step p99 ms | mask fill p50 / p99 ms "
        "| tok/s | ratio to free |",
        "|---|---|---|---|---|---|---|",
    ]
    free = next((r["p50_ms"] for r in rows if r["constrained"] == 0), float("nan"))
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['constrained']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['fill_p50_ms']:.2f} / {r['fill_p99_ms']:.2f} | {r['tok_s']:.0f} | "
            f"{r['p50_ms'] / free:.3f} |"
        )
    return "\n".join(lines)


def compile_tables(args, model_dir: Path, vocab: int, eos, rows: list[dict]) -> list[str]:
    tok_dir = args.tokenizer or model_dir
    if args.tokenizer is not None:
        vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
        eos = json.loads((tok_dir / "config.json").read_text())["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    which = "synthetic 128k BPE" if args.tokenizer is None else str(args.tokenizer.name)
    tables = []
    if rows:
        tables.append(decode_table(rows))
    tables.append(compile_table(
        f"llguidance, {which} tokenizer", llguidance_times(tok_dir, vocab, eos_ids, args.repeats)
    ))  # fmt: skip
    if args.xgrammar:
        xr = xgrammar_times(tok_dir, vocab, args.repeats)
        if xr is not None:
            tables.append(compile_table(f"xgrammar, {which} tokenizer", xr))
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--cpu-masks", action="store_true", help="mask fill times only (CPU)")
    ap.add_argument("--tokenizer", type=Path, help="a folder with tokenizer.json (compile part)")
    ap.add_argument("--xgrammar", action="store_true", help="time xgrammar too, if installed")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--kv-gb", type=int, default=24)
    ap.add_argument("--append", help="append the tables to this file")
    args = ap.parse_args()
    args.cfg = TINY if args.smoke else LLAMA3_8B
    args.device = "cpu" if args.smoke or args.compile_only or args.cpu_masks else "cuda"
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.batch, args.ctx, args.steps, args.repeats, args.kv_gb = 8, 16, 12, 3, 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_config(Path(tmp) / "model", args.cfg)
        vocab, eos = args.cfg["vocab_size"], args.cfg["eos_token_id"]
        write_synthetic_tokenizer(model_dir, vocab, args.cfg["bos_token_id"], eos)
        rows: list[dict] = []
        if args.cpu_masks:
            from benchmarks.structured_masks import mask_table, mask_times

            tables = [mask_table(mask_times(model_dir, vocab, [eos], args.batch // 2, args.steps))]
        else:
            if not args.compile_only:
                asyncio.run(decode(args, model_dir, rows))
            tables = compile_tables(args, model_dir, vocab, eos, rows)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()}-core CPU"
    text = "\n\n".join(tables)
    print(text)
    if args.append:
        import datetime

        with open(args.append, "a") as f:
            f.write(
                f"\n- date: {datetime.date.today()}, commit: {git_commit()}, device: {device}\n"
                f"- command: `python -m benchmarks.structured "
                f"{' '.join(sys.argv[1:])}`\n\n{text}\n"
            )


if __name__ == "__main__":
    main()
