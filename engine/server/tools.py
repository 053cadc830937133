"""Chat tool calling: ``tools`` and ``tool_choice`` in, ``tool_calls`` out (OpenAI shapes).

The tool format is the model's own, as its chat template defines it:
- ``llama3``: a template that knows Llama 3's ``ipython`` role or ``<|python_tag|>``; the
  model answers with a JSON object ``{"name": ..., "parameters": {...}}`` (several: ``;``);
- ``hermes``: any other template; calls are ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks. A template that does not render ``tools`` at all gets them from a
  system message written here in that format, and earlier calls and results in the history
  as the same tags.

``tool_choice``: ``none`` (tools are not shown, nothing is parsed), ``auto`` (free text, calls
parsed from it), ``required`` and a named function: the output is grammar-constrained JSON
(``required``: an array of 1 to ``MAX_REQUIRED_CALLS`` ``{"name", "parameters"}`` objects over
the given tools, exactly one with ``parallel_tool_calls: false``; a named function: its
arguments object), so the call is well-formed whatever the model would write.

Calls are read back from the output by ``tool_calls.py``; the fields are checked by
``tool_checks.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from loraplex.engine.server.body import check_depth
from loraplex.engine.server.errors import APIError
from loraplex.engine.server.fields import tree_chars
from loraplex.engine.server.limits import ServerLimits
from loraplex.engine.server.tool_calls import (
    CLOSE,
    MAX_REQUIRED_CALLS,
    OPEN,
    ToolStream,
    arguments_value,
    parse_calls,
)
from loraplex.engine.server.tool_checks import check_tool
from loraplex.engine.structured import StructuredOutput

__all__ = ["Tools", "parse_tools", "tool_messages", "parse_calls", "ToolStream", "tool_format"]


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True)
class Tools:
    tools: list[dict[str, Any]]  # as sent: {"type": "function", "function": {...}}
    choice: str  # "auto" | "none" | "required" | "named"
    name: str | None = None  # the function of a named choice
    parallel: bool = True  # ``parallel_tool_calls``: false allows one call (``required``)
    chars: int = 0  # characters of the tools' strings (they count as prompt text)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> Any:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def constraint(self) -> StructuredOutput | None:
        """The grammar of ``required`` / a named function (None for ``auto``)."""
        if self.choice == "named":
            assert self.name is not None
            return StructuredOutput.json_schema(self.parameters(self.name), "tools")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [n]}, "parameters": self.parameters(n)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n in self.names
        ]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        most = MAX_REQUIRED_CALLS if self.parallel else 1  # (an end: generation stops there)
        schema = {"type": "array", "items": one, "minItems": 1, "maxItems": most}
        return StructuredOutput.json_schema(schema, "tools")


def _named(choice: dict[str, Any], names: set[str]) -> str:
    """The function a ``{"type": "function", "function": {"name": ...}}`` choice names."""
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise _bad('tool_choice.function must be an object {"name": ...}', "tool_choice.function")
    name = fn.get("name")
    if not isinstance(name, str) or name not in names:
        ok = isinstance(name, str) and len(name) <= 64 and name.isprintable()
        shown = repr(name) if ok else "a value"
        raise _bad(
            f"tool_choice.function.name names {shown}, which is not among the tools' names",
            "tool_choice.function.name",
        )
    return name


def parse_tools(body: dict[str, Any], limits: ServerLimits) -> Tools | None:
    """``tools`` / ``tool_choice`` of a chat request; None when no tool may be called."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise _bad("tools must be a list of function tools", "tools")
    check_depth(raw, limits.max_json_depth, "tools")
    chars = tree_chars(raw, "tools")  # (the tools are rendered into the prompt)
    tools, seen = [], set()
    for i, t in enumerate(raw):
        tool = check_tool(i, t)
        name = tool["function"]["name"]
        if name in seen:
            p = f"tools[{i}].function.name"
            raise _bad(f"{p}: two tools are named {name!r}", p)
        seen.add(name)
        tools.append(tool)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice is None or choice in ("auto", "none", "required"):
        kind = choice or "auto"
        return None if kind == "none" else Tools(tools, kind, parallel=parallel, chars=chars)
    if isinstance(choice, dict) and choice.get("type") == "function":
        return Tools(tools, "named", _named(choice, seen), parallel, chars)
    raise _bad(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


# -- prompts --------------------------------------------------------------------------------------


def tool_format(template: str | None) -> str:
    """The template's tool format: "llama3" or "hermes"."""
    t = template or ""
    return "llama3" if "<|python_tag|>" in t or "ipython" in t else "hermes"


def _renders_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template or "") is not None


_SYSTEM = (
    "You can call functions. Their signatures, one JSON object per line, are inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call functions, answer with one <tool_call></tool_call> block per call, each holding a "
    "JSON object with the function's name and its arguments:\n"
    '<tool_call>\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
)


def tool_messages(
    messages: list[dict[str, Any]], tools: Tools | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and template kwargs for a chat with tools (or with tool turns in history)."""
    if _renders_tools(template):
        out = []
        for m in messages:  # templates read arguments as objects (``| tojson``)
            if m.get("tool_calls"):
                calls = [
                    {**c, "function": {**c["function"], "arguments": arguments_value(
                        c["function"].get("arguments"))}}
                    if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
                    for c in m["tool_calls"]
                ]  # fmt: skip
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out, ({"tools": tools.tools} if tools is not None else {})
    out = []
    for m in messages:  # history in the hermes tags the system message below teaches
        if m.get("tool_calls"):
            blocks = [
                f"{OPEN}\n" + json.dumps({"name": f.get("name"), "arguments": arguments_value(
                    f.get("arguments"))}, ensure_ascii=False) + f"\n{CLOSE}"
                for c in m["tool_calls"] if isinstance(c, dict)
                for f in [c.get("function") or {}]
            ]  # fmt: skip
            text = "\n".join(x for x in [m.get("content") or "", *blocks] if x)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        elif m.get("role") == "tool":
            m = {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools is not None:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
        system = _SYSTEM.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}
