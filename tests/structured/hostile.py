"""Constraints that hostile clients sent: each ended the server's process before the grammar
sandbox (structured/sandbox.py). Shared by the sandbox, server and fuzz tests."""

from __future__ import annotations

__all__ = ["defs_chain", "gbnf_chain", "rule_chain"]


def defs_chain(links: int) -> dict:
    """``d_i = {"type": "object", "properties": {"a": {"$ref": "#/$defs/d_{i+1}"}}}``."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(links)
    }
    defs[f"d{links}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(rules: int) -> str:
    """A Lark grammar ``r_i: "a" r_{i+1}`` of ``rules`` rules."""
    lines = ['start: "a" r1'] + [f'r{i}: "a" r{i + 1}' for i in range(1, rules)]
    return "\n".join([*lines, f'r{rules}: "b"'])


def gbnf_chain(rules: int) -> str:
    """The same chain in GBNF (converted to Lark in pure Python: quadratic, seconds for 4k)."""
    lines = ['root ::= "a" r1'] + [f'r{i} ::= "a" r{i + 1}' for i in range(1, rules)]
    return "\n".join([*lines, f'r{rules} ::= "b"'])
