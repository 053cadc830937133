"""Validating the tool fields of a chat request: the ``tools`` definitions and the tool turns of
the history (assistant ``tool_calls``, ``tool`` messages). Each refusal is a 400 naming the
field (``tools[1].function.name``, ``messages[2].tool_calls[0].function``), so nothing
malformed reaches the chat template or the grammar.
"""

from __future__ import annotations

import re
from typing import Any

from loraplex.engine.server.errors import APIError
from loraplex.engine.server.schema_shape import schema_problem

__all__ = ["check_tool", "check_tool_turns", "NAME"]

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function names


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def check_tool(i: int, tool: Any) -> dict[str, Any]:
    """``tools[i]`` as ``{"type": "function", "function": {...}}``; its strings are already
    checked as UTF-8 (``fields.tree_chars``)."""
    param = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _bad(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param)
    if tool.get("type") != "function":
        raise _bad(f"{param}.type must be 'function' (the only tool type)", f"{param}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{param}.function must be an object", f"{param}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(f"{param}.function.name must match {NAME.pattern}", f"{param}.function.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        p = f"{param}.function.description"
        raise _bad(f"{p} must be a string", p)
    _check_parameters(fn.get("parameters"), f"{param}.function.parameters")
    return {"type": "function", "function": fn}


def _check_parameters(params: Any, param: str) -> None:
    """A function's arguments schema: an object schema (OpenAI's rule), well-shaped."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise _bad(f"{param} must be a JSON schema object", param)
    problem = schema_problem(params, param)
    if problem is not None:
        raise _bad(problem, param)
    if params.get("type", "object") != "object":
        raise _bad(f"{param} must be a schema of type 'object' (the arguments object)", param)


def _check_call(call: Any, param: str) -> str:
    """One entry of an assistant message's ``tool_calls``; its id."""
    if not isinstance(call, dict):
        raise _bad(f"{param} must be an object with an id and a function", param)
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{param}.id must be a non-empty string", f"{param}.id")
    if call.get("type", "function") != "function":
        raise _bad(f"{param}.type must be 'function'", f"{param}.type")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise _bad(
            f'{param}.function must be an object {{"name", "arguments"}}', f"{param}.function"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{param}.function.name must be a non-empty string", f"{param}.function.name")
    args = fn.get("arguments")
    if args is not None and not isinstance(args, (str, dict)):
        p = f"{param}.function.arguments"
        raise _bad(f"{p} must be a JSON string (or an object)", p)
    return call_id


def check_tool_turns(messages: list[dict[str, Any]]) -> None:
    """The tool turns of a chat history (messages already checked as objects with a role).

    As OpenAI: every ``tool`` message answers, by its ``tool_call_id``, a call that an
    earlier assistant message made (its ``tool_calls[].id``)."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            param = f"messages[{i}].tool_calls"
            if not isinstance(calls, list):
                raise _bad(f"{param} must be a list of tool calls", param)
            called.update(_check_call(call, f"{param}[{j}]") for j, call in enumerate(calls))
        if m["role"] == "tool":
            param = f"messages[{i}].tool_call_id"
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{param} must be the id of the tool call this message answers", param)
            if call_id not in called:
                shown = f" ({call_id!r})" if len(call_id) <= 64 and call_id.isprintable() else ""
                raise _bad(
                    f"{param}: no earlier assistant message made a tool call with this id{shown}",
                    param,
                )
