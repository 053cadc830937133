"""Fuzz the structured-output compile path with hostile constraints (hypothesis).

Every input goes the way a request's does: ``StructuredOutput``'s builders (schema checks),
then ``GrammarCache.guide`` (the sandbox process, then the engine's own compile); an accepted
constraint's matcher is then walked in this process through the engine's mask path
(``bitmask.fill_masks``) and ``Guide.accept``, as the step thread would. Inputs: JSON schemas
(numeric bounds at and beyond the 64-bit and float edges, deep and recursive ``$ref``, huge
enums, odd formats and patterns), regexes, Lark and GBNF grammars, choice lists and tool
definitions (the server's tool constraint).

What counts: this process must not die (it is the engine's side: a crash here is a crash of
the server) and nothing but ``InvalidRequestError`` may come out (anything else is a 500).
Crashes the sandbox contained are counted, not failures. Run it in a subprocess:

    python -m benchmarks.fuzz_grammars --seconds 60 [--seed N] [--last FILE] [--table]

``--last``: each input is written there before it runs (so a dead run names its input).
Prints one JSON summary line (``--table``: and a markdown table for BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BATCH = 25  # examples per hypothesis run (each run a new seed)

EDGES = [
    0, 1, -1, 2**31, -(2**31), 2**53, -(2**53), 2**53 + 1, -(2**53) - 1, 2**62, -(2**62),
    2**63 - 1, -(2**63), -(2**63) + 1, -(2**63) + 2, 2**63, 2**64, -(2**64), 10**19, -(10**19),
    10**30, 1e19, -1e19, 2e19, -2e19, 1e300, -1e300, 1e308, -1e308, 5e-324, 1e-30, 0.5, -0.5,
    1.5, 1.7,
]  # fmt: skip
NUMBERS = st.one_of(st.sampled_from(EDGES), st.integers(-(2**70), 2**70), st.floats())
FORMATS = ["date-time", "date", "time", "email", "uuid", "ipv4", "ipv6", "hostname", "uri",
           "duration", "regex", "no-such-format", ""]  # fmt: skip
REGEX_ATOMS = [
    "a", ".", r"\d", r"\w", r"\s", r"[^\s\S]", r"[a-z]", r"[^a]", r"\p{L}", r"\u{10FFFF}", "^",
    "$", r"\b", "(?=a)", "(?!a)", r"\1", "[", "(", "*", "\\", "é", "\x00", "💥", r"[\d-z]",
]  # fmt: skip


def regexes() -> st.SearchStrategy[str]:
    atom = st.sampled_from(REGEX_ATOMS)

    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        quant = st.sampled_from(["*", "+", "?", "{2}", "{0,3}", "{1000}", "{1,100000}", "{3,1}",
                                 "{99999999999}", "*?"])  # fmt: skip
        return st.one_of(
            st.tuples(inner, quant).map(lambda t: f"({t[0]}){t[1]}"),
            st.lists(inner, min_size=2, max_size=4).map("|".join),
            st.lists(inner, min_size=2, max_size=4).map("".join),
        )

    return st.recursive(atom, grow, max_leaves=12)


def _numeric() -> st.SearchStrategy[dict]:
    keys = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]
    return st.builds(
        lambda t, bounds: {"type": t, **bounds},
        st.sampled_from(["integer", "number", ["integer", "null"], None]),
        st.dictionaries(st.sampled_from(keys), st.one_of(NUMBERS, st.booleans()), max_size=3),
    ).map(lambda d: {k: v for k, v in d.items() if v is not None})


def _strings() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "format": st.sampled_from(FORMATS),
            "pattern": regexes(),
            "minLength": st.sampled_from([0, 1, 5, 1000, 10**9, -1]),
            "maxLength": st.sampled_from([0, 1, 5, 1000, 10**9]),
            "enum": st.lists(st.text(max_size=8), max_size=50),
        },
    )


def _leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        _numeric(), _strings(), st.booleans(),
        st.just({"type": "boolean"}), st.just({"type": "null"}), st.just({}),
        st.builds(lambda v: {"const": v}, st.one_of(NUMBERS, st.text(max_size=5))),
        st.builds(lambda n: {"enum": list(range(n))}, st.sampled_from([1, 100, 5000])),
        st.just({"$ref": "#"}), st.just({"$ref": "#/$defs/missing"}),
    )  # fmt: skip


def schemas() -> st.SearchStrategy[Any]:
    def grow(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)
        return st.one_of(
            st.builds(
                lambda props, req, extra: {
                    "type": "object",
                    "properties": props,
                    "required": req,
                    "additionalProperties": extra,
                },
                st.dictionaries(names, inner, max_size=4),
                st.lists(names, max_size=3),
                st.one_of(st.booleans(), inner),
            ),  # fmt: skip
            st.builds(
                lambda items, lo, hi: {
                    "type": "array",
                    "items": items,
                    "minItems": lo,
                    "maxItems": hi,
                },
                inner,
                st.sampled_from([0, 1, 3, 1000]),
                st.sampled_from([0, 2, 5, 10**6]),
            ),  # fmt: skip
            st.builds(
                lambda k, xs: {k: xs},
                st.sampled_from(["anyOf", "oneOf", "allOf"]),
                st.lists(inner, min_size=1, max_size=3),
            ),  # fmt: skip
            st.builds(lambda a, b: {"$ref": "#/$defs/x", "$defs": {"x": a, "y": b}}, inner, inner),
        )

    return st.one_of(st.recursive(_leaves(), grow, max_leaves=10), deep_schemas())


def deep_schemas() -> st.SearchStrategy[dict]:
    def chain(n: int, recursive: bool) -> dict:
        defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
                for i in range(n)}  # fmt: skip
        defs[f"d{n}"] = {"$ref": "#/$defs/d0"} if recursive else {"type": "integer"}
        return {"$ref": "#/$defs/d0", "$defs": defs}

    def nest(n: int) -> dict:
        node: dict = {"type": "integer"}
        for _ in range(n):
            node = {"type": "array", "items": node}
        return node

    sizes = st.sampled_from([10, 100, 400, 800, 1000, 1500])
    return st.one_of(
        st.builds(chain, sizes, st.booleans()), st.builds(nest, st.sampled_from([10, 60, 200]))
    )


def grammars() -> st.SearchStrategy[str]:
    def lark(rules: list[tuple[str, str]]) -> str:
        return "\n".join(["start: r0", *(f"r{i}: {a} {b}" for i, (a, b) in enumerate(rules))])

    def gbnf(rules: list[tuple[str, str]]) -> str:
        body = [f"r{i} ::= {a} {b}" for i, (a, b) in enumerate(rules)]
        return "\n".join(["root ::= r0", *(line.replace("/", '"') for line in body)])

    def chain(n: int, form: str) -> str:
        if form == "gbnf":
            return "\n".join(["root ::= r0", *(f'r{i} ::= "a" r{i + 1}' for i in range(n)),
                              f'r{n} ::= "b"'])  # fmt: skip
        return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(n)), f'r{n}: "b"'])

    parts = st.sampled_from(['"a"', "r0", "r1", "r5", '/[0-9]+/', "/[^\\s\\S]/", "%ignore",
                             '"a"*', "(r0 | r1)+", '""', "r0 r0", "~", '/(a|b)*c{1000}/'])  # fmt: skip
    rules = st.lists(st.tuples(parts, parts), min_size=1, max_size=8)
    return st.one_of(
        st.builds(lark, rules), st.builds(gbnf, rules),
        st.builds(chain, st.sampled_from([10, 500, 2000, 3000]), st.sampled_from(["lark", "gbnf"])),
        st.text(max_size=200),
    )  # fmt: skip


def tools() -> st.SearchStrategy[dict]:
    return st.builds(
        lambda name, params, choice: {"tools": [{"type": "function", "function": {
            "name": name, "parameters": params}}], "tool_choice": choice},
        st.sampled_from(["f", "get_weather", "x" * 64]),
        schemas().filter(lambda s: isinstance(s, dict)),
        st.sampled_from(["required", {"type": "function", "function": {"name": "f"}}]),
    )  # fmt: skip


def inputs() -> st.SearchStrategy[tuple[str, Any]]:
    return st.one_of(
        st.tuples(st.just("json"), schemas()),
        st.tuples(st.just("regex"), regexes()),
        st.tuples(st.just("grammar"), grammars()),
        st.tuples(st.just("choice"), st.one_of(
            st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=200),
            st.builds(lambda n: [f"c{i}" for i in range(n)], st.sampled_from([1000, 20000])),
        )),
        st.tuples(st.just("tools"), tools()),
    )  # fmt: skip


class Runner:
    """The engine side of each input (module docstring)."""

    def __init__(self, last: Path | None, seed: int, findings: Path | None = None) -> None:
        import logging

        import structlog

        from loraplex.engine.demo import demo_model_dir
        from loraplex.engine.structured.grammars import GrammarCache
        from loraplex.engine.tokenizer import Tokenizer

        # (refusals are logged as warnings: thousands of lines here, and stdout holds the summary)
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
        tok = Tokenizer.from_dir(demo_model_dir())
        self.tok = tok
        self.eos = sorted(tok.eos_token_ids)
        self.cache = GrammarCache(tok.backend.to_str, tok.vocab_size, self.eos,
                                  compile_timeout_s=5.0, cache_bytes=256 << 20)  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.last = last
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.invalid_outputs = 0
        self.findings = findings  # contained crashes and invalid outputs, one file each

    def keep(self, what: str, data: Any) -> None:
        if self.findings is not None:
            self.findings.mkdir(parents=True, exist_ok=True)
            n = len(list(self.findings.iterdir()))
            (self.findings / f"{n:05d}-{what}.json").write_text(json.dumps(data, default=repr))

    def spec(self, kind: str, value: Any) -> Any:
        from loraplex.engine.structured import StructuredOutput

        if kind == "json":
            return StructuredOutput.json_schema(value, "response_format")
        if kind == "tools":
            from loraplex.engine.server.limits import ServerLimits
            from loraplex.engine.server.tools import parse_tools

            tools = parse_tools(value, ServerLimits())
            return None if tools is None else tools.constraint()
        return getattr(StructuredOutput, kind)(value, f"guided_{kind}")

    def run_one(self, kind: str, value: Any) -> None:
        from loraplex.engine.errors import InvalidRequestError
        from loraplex.engine.server.errors import APIError

        if self.last is not None:
            self.last.write_text(json.dumps([kind, value], default=repr))
        self.counts["inputs"] += 1
        try:
            spec = self.spec(kind, value)
            if spec is None:
                self.counts["unconstrained"] += 1
                return
            guide = self.loop.run_until_complete(self.cache.guide(spec))
        except (InvalidRequestError, APIError) as e:
            msg = str(getattr(e, "message", e))
            if "crashed" in msg:
                self.keep("crash", [kind, value, msg])
            self.counts["refused: crash (contained)" if "crashed" in msg else
                        "refused: budget" if "--grammar-" in msg else "refused"] += 1  # fmt: skip
            return
        self.counts["accepted"] += 1
        self.walk(guide, kind, value)

    def walk(self, guide: Any, kind: str, value: Any) -> None:
        """Masks and tokens through the engine's own path, as the step thread runs them."""
        import torch

        from loraplex.engine.structured.bitmask import fill_masks

        vocab = self.cache.vocab_size
        out: list[int] = []
        for _ in range(48):
            mask = fill_masks([guide], vocab, self.eos, pin=False)[0]
            bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            allowed = bits.reshape(-1)[:vocab].nonzero().flatten().tolist()
            free = [t for t in allowed if t not in self.eos]
            if not free or guide.matcher.is_stopped():
                break
            token = self.rng.choice(free)
            guide.accept(token)
            out.append(token)
        if kind == "json" and guide.matcher.is_accepting() and not guide.failed:
            self.counts["walks completed"] += 1
            text = self.tok.decode(out)
            if not self.check_output(value, text):
                self.keep("invalid", [value, text])

    def check_output(self, schema: Any, text: str) -> bool:
        """A completed walk's text against its schema (jsonschema); False: it does not
        validate. Schemas jsonschema itself refuses (e.g. draft-4 boolean bounds) are skipped."""
        try:
            import jsonschema
        except ImportError:
            return True
        try:
            jsonschema.validate(json.loads(text), schema)
        except jsonschema.SchemaError:
            self.counts["walks unchecked (schema outside jsonschema's drafts)"] += 1
        except (jsonschema.ValidationError, ValueError):
            self.invalid_outputs += 1
            return False
        except Exception:  # noqa: BLE001 - e.g. a $ref jsonschema cannot resolve
            self.counts["walks unchecked (jsonschema failed)"] += 1
        return True

    def close(self) -> None:
        self.cache.close()
        self.loop.close()


def run(
    seconds: float, seed: int, last: Path | None, findings: Path | None = None
) -> dict[str, Any]:
    """Batches of hypothesis examples (seeds ``seed``, ``seed + 1``, ...) until ``seconds``."""
    from hypothesis import seed as seeded

    runner = Runner(last, seed, findings)
    t0 = time.monotonic()
    batch = 0
    try:
        while time.monotonic() - t0 < seconds:

            @seeded(seed + batch)
            @settings(max_examples=BATCH, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(inputs())
            def fuzz(case: tuple[str, Any]) -> None:
                runner.run_one(*case)

            fuzz()
            batch += 1
    finally:
        runner.close()
    summary: dict[str, Any] = dict(runner.counts)
    summary.update(
        seconds=round(time.monotonic() - t0, 1), seed=seed,
        sandbox_crashes=runner.cache.sandbox.crashes, sandbox_timeouts=runner.cache.sandbox.timeouts,
        invalid_outputs=runner.invalid_outputs, engine_crashes=0,
    )  # fmt: skip
    return summary


def table(summary: dict[str, Any]) -> str:
    return "| what | count |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in summary.items())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--last", type=Path, default=None)
    ap.add_argument("--table", action="store_true", help="also print a markdown table")
    ap.add_argument("--findings", type=Path, default=None, help="keep crashes / invalid outputs")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    summary = run(args.seconds, seed, args.last, args.findings)
    print(json.dumps(summary), flush=True)
    if args.table:
        print(table(summary))


if __name__ == "__main__":
    main()
