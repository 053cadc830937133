"""Tool calls in a model's output: ``parse_calls`` for a whole output, ``ToolStream`` for one
streamed choice. Formats (``tools.tool_format``): Hermes ``<tool_call>`` blocks, Llama 3 JSON,
and the grammar-constrained JSON of ``tool_choice`` ``required`` / a named function.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Protocol

__all__ = ["parse_calls", "ToolStream", "arguments_value", "OPEN", "CLOSE", "MAX_REQUIRED_CALLS"]


class Tools(Protocol):
    """What reading calls back needs of a request's tools (``tools.Tools`` has it; named here,
    not imported, so that tools.py -> tool_calls.py is the only arrow between the two)."""

    choice: str  # "auto" | "required" | "named"
    name: str | None  # the function of a named choice


OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Calls one ``tool_choice: "required"`` output may hold with ``parallel_tool_calls`` (one
# without): the grammar's array ends there, so a model that would open call after call (small
# ones do, greedily) stops instead of running to ``max_tokens``.
MAX_REQUIRED_CALLS = 8


def arguments_value(value: Any) -> Any:
    """Arguments as an object where they are JSON text (else as they are)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _from_object(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = arguments_value(args)
    if not isinstance(args, dict):
        return None
    return _call(obj["name"], args)


def _hermes_block(raw: str) -> dict[str, Any] | None:
    try:
        return _from_object(json.loads(raw.strip()))
    except ValueError:
        return None


def _llama3(text: str) -> list[dict[str, Any]] | None:
    text = text.strip().removeprefix("<|python_tag|>").strip()
    if not text.startswith("{"):
        return None
    try:
        objs = [json.loads(text)]
    except ValueError:
        try:
            objs = [json.loads(p) for p in text.split(";") if p.strip()]
        except ValueError:
            return None
    calls = [_from_object(o) for o in objs]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


class _RequiredCalls:
    """The calls of a ``required`` output, ``[{"name": ..., "parameters": {...}}, ...]`` (JSON
    its grammar enforces), taken as each object closes: text comes in pieces, and an output cut
    at ``length`` yields the calls it completed. Each character is scanned once."""

    _SPECIAL = re.compile(r'["\\{}\[\]]')

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0  # scanned up to here
        self.depth = 0  # open arrays / objects at ``pos``
        self.in_string = False
        self.start = -1  # where the open call object starts (-1: none)

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        calls = []
        while (m := self._SPECIAL.search(self.buf, self.pos)) is not None:
            ch, i = m.group(), m.start()
            self.pos = i + 1
            if self.in_string:
                if ch == "\\":
                    self.pos += 1  # the escaped character (it may still be to come)
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.start = i
            else:
                self.depth -= 1
                if self.depth == 1 and ch == "}" and self.start >= 0:
                    call = _required_call(self.buf[self.start : i + 1])
                    if call is not None:
                        calls.append(call)
                    self.start = -1
        if self.start < 0:  # nothing to keep before the scan point
            cut = min(self.pos, len(self.buf))  # (pos may be past an escape still to come)
            self.buf, self.pos = self.buf[cut:], self.pos - cut
        return calls


def _required_call(raw: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return _from_object(obj) if isinstance(obj, dict) and "parameters" in obj else None


def parse_calls(text: str, tools: Tools, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output."""
    if tools.choice == "named":
        assert tools.name is not None
        return None, [_call(tools.name, text)]
    if tools.choice == "required":  # (content: never; an unfinished last call is dropped)
        return None, _RequiredCalls().feed(text)
    if fmt == "llama3":
        calls = _llama3(text)
        return (None, calls) if calls else (text or None, [])
    stream = ToolStream(tools, fmt)
    content, calls = stream.feed(text)
    more, rest = stream.finish()
    content = (content + more).strip()
    return content or None, calls + rest


class ToolStream:
    """Streams one choice: text deltas in, (content delta, finished tool calls) out."""

    def __init__(self, tools: Tools, fmt: str) -> None:
        self.tools, self.fmt = tools, fmt
        self.buf = ""
        self.inside = False  # hermes: between OPEN and CLOSE
        self.mode: str | None = None  # llama3: "json" (buffer) or "text", once decided
        self.pending_ws = ""  # whitespace not sent yet (trailing, or between calls)
        self.count = 0  # tool calls sent
        self.named_id: str | None = None
        self.required = _RequiredCalls()

    def _content(self, text: str) -> str:
        if not text.strip():
            self.pending_ws += text
            return ""
        out, self.pending_ws = self.pending_ws + text, ""
        return out

    def _index(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for c in calls:
            out.append({"index": self.count, **c})
            self.count += 1
        return out

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        choice = self.tools.choice
        if choice == "named":  # arguments stream as they come
            if not text:
                return "", []
            if self.named_id is None:
                call = _call(self.tools.name or "", text)
                self.named_id = call["id"]
                self.count = 1
                return "", [{"index": 0, **call}]
            return "", [{"index": 0, "function": {"arguments": text}}]
        if choice == "required":  # each call as soon as its object closes
            return "", self._index(self.required.feed(text))
        self.buf += text
        if self.fmt == "llama3":
            if self.mode is None:
                head = self.buf.lstrip()
                if not head:
                    return "", []
                self.mode = "json" if head.startswith(("{", "<|python_tag|>")) else "text"
            if self.mode == "json":
                return "", []
            out, self.buf = self.buf, ""
            return self._content(out), []
        content, calls = "", []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i >= 0:
                    content += self.buf[:i]
                    self.buf, self.inside = self.buf[i + len(OPEN) :], True
                    continue
                keep = next(
                    (k for k in range(len(OPEN) - 1, 0, -1) if self.buf.endswith(OPEN[:k])), 0
                )
                content += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                break
            j = self.buf.find(CLOSE)
            if j < 0:
                break
            raw, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE) :], False
            call = _hermes_block(raw)
            if call is None:
                content += OPEN + raw + CLOSE  # not a call after all: it is text
            else:
                calls += self._index([call])
        return self._content(content) if content else "", calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest at the end of the output."""
        buf, self.buf = self.buf, ""
        if self.tools.choice == "named":
            return "", []
        if self.tools.choice == "required":
            return "", []  # (sent as they closed; an unfinished one was cut at length)
        if self.fmt == "llama3" and self.mode == "json":
            content, calls = parse_calls(buf, self.tools, self.fmt)
            if calls:
                return "", self._index(calls)
            return self._content(content or ""), []
        if self.inside:  # an unclosed last call
            call = _hermes_block(buf)
            if call is not None:
                return "", self._index([call])
            buf = OPEN + buf
        return (self._content(buf) if buf else ""), []
