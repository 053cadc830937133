"""Mask fill on the host, CPU only: the decode benchmark's schema on its synthetic tokenizer.

    python -m benchmarks.structured --cpu-masks [--batch 64] [--steps 40]

``--batch // 2`` rows under the decode benchmark's schema (``tests/structured/forms.LONG``),
each along its own valid output (random words of 0-16 characters, tokenized), started at
staggered offsets so the rows sit at different places in their strings. Times:

- per row: one matcher's mask at a time (µs per row and token),
- per step: all rows' masks filled by ``llguidance.LLExecutor`` on 1 and on every CPU's
  thread, the rows either copies of one compiled matcher (the engine before lanes: they share
  one lexer and its mutex) or spread over lanes of independently compiled matchers, one lane
  per thread (the engine's ``GrammarCache``). Wall ms per step and CPU ms per step (all
  threads): CPU / wall is the parallelism the fill got.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.bitmask import mask_words
from loraplex.engine.structured.grammars import GrammarCache, grammar_text
from tests.structured.forms import LONG


def _paths(tokenizer_dir: Path, rows: int, steps: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out = []
    for r in range(rows):
        g = random.Random(r)
        words = ["".join(g.choice("abcdefghij klmnop0123") for _ in range(g.randint(0, 16)))
                 for _ in range(steps)]  # fmt: skip
        ids = tok.encode("[" + ", ".join(json.dumps(w) for w in words), add_special_tokens=False)
        skip = g.randrange(8)  # staggered: rows at different places in their strings
        out.append(ids.ids[: skip + steps])
    return out


def mask_times(tokenizer_dir: Path, vocab: int, eos: list[int], rows: int, steps: int) -> dict:
    import llguidance

    text = (tokenizer_dir / "tokenizer.json").read_text()
    cache = GrammarCache(lambda: text, vocab, eos, lanes=1)
    spec = StructuredOutput.json_schema(LONG)
    one = cache.compile(grammar_text(spec))
    paths = _paths(tokenizer_dir, rows, steps)
    words = mask_words(vocab)
    mask = torch.empty((rows, words), dtype=torch.int32)
    out: dict = {"rows": rows, "steps": steps, "cpus": os.cpu_count(), "fill": {}}

    def start(m: llguidance.LLMatcher, path: list[int]) -> llguidance.LLMatcher:
        skip = len(path) - steps
        assert m.consume_tokens(path[:skip]), m.get_error()
        return m

    # one row at a time (a copy of the warm matcher each)
    per_row = []
    for path in paths:
        m = start(one.deep_copy(), path)
        for t in path[len(path) - steps :]:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
            per_row.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    out["per_row_us"] = per_row
    threads = sorted({1, os.cpu_count() or 1})
    lanes = [one] + [cache.compile(grammar_text(spec)) for _ in range(max(threads) - 1)]
    for n in threads:
        ex = llguidance.LLExecutor(n)
        for mode in ("copies", "lanes"):
            src = [one] * rows if mode == "copies" else [lanes[i % n] for i in range(rows)]
            ms = [start(s.deep_copy(), p) for s, p in zip(src, paths, strict=True)]
            order = sorted(range(rows), key=lambda i: i % n if mode == "lanes" else 0)
            wall, cpu = [], []
            for k in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                ex.unsafe_compute_mask_ptr([(ms[i], i) for i in order], mask.data_ptr(),
                                           words * 4, rows)  # fmt: skip
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                for m, p in zip(ms, paths, strict=True):
                    assert m.consume_token(p[len(p) - steps + k]), m.get_error()
            out["fill"][(mode, n)] = (wall, cpu)
    cache.close()
    return out


def mask_table(r: dict) -> str:
    per_row = r["per_row_us"]
    lines = [
        f"{r['rows']} rows under the decode benchmark's schema, {r['steps']} steps each, "
        f"{r['cpus']} CPUs; one row's mask: p50 {statistics.median(per_row) * 1e6:.0f} µs, "
        f"mean {statistics.mean(per_row) * 1e6:.0f} µs, "
        f"max {max(per_row) * 1e6:.0f} µs",
        "",
        "| rows' matchers | threads | fill p50 ms | fill mean ms | CPU ms per step | CPU / wall |",
        "|---|---|---|---|---|---|",
    ]
    for (mode, n), (wall, cpu) in r["fill"].items():
        what = "copies of one (before)" if mode == "copies" else "lanes, one per thread"
        lines.append(
            f"| {what} | {n} | {statistics.median(wall) * 1e3:.1f} | "
            f"{statistics.mean(wall) * 1e3:.1f} | {statistics.mean(cpu) * 1e3:.1f} | "
            f"{sum(cpu) / sum(wall):.2f} |"
        )
    return "\n".join(lines)
