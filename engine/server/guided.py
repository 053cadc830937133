"""Structured-output request fields -> one ``StructuredOutput``.

Forms (one per request):
- OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- vLLM's current ``structured_outputs``: ``{"json": schema}``, ``{"regex": "..."}``,
  ``{"choice": [...]}``, ``{"grammar": "..."}`` or ``{"json_object": true}`` (errors name
  ``structured_outputs.json`` etc.; any other key is refused but vLLM's options that change
  nothing here);
- vLLM's older fields, accepted as aliases: ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``.

Errors are 400s naming the field (``param``); a constraint that parses here but does not
compile (bad schema, unsupported keyword, bad regex) is refused by the engine's compile, also
naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.server.body import check_depth
from loraplex.engine.server.errors import APIError
from loraplex.engine.server.fields import field_path
from loraplex.engine.server.limits import ServerLimits, flag
from loraplex.engine.structured import StructuredOutput

__all__ = ["parse_structured"]

_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_FORMS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _too_deep(param: str, limits: ServerLimits) -> APIError:
    limit = limits.max_json_depth
    return _bad(f"{param} nests JSON deeper than {limit} levels ({flag('max_json_depth')})", param)


def _schema(value: Any, param: str, limits: ServerLimits) -> Any:
    """A JSON schema as an object (a boolean mapped, see below): JSON text is parsed here under
    the depth bound that object schemas get from ``check_depth`` (json.loads would raise
    RecursionError past ~1000 levels, and llguidance refuses past 128 without naming the
    field)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise _too_deep(param, limits) from None
        except ValueError as e:
            raise _bad(f"{param}: the schema is not valid JSON: {e}", param) from None
        check_depth(value, limits.max_json_depth, param)
    # Booleans are schemas: true accepts any JSON value (as {} does, which llguidance takes;
    # it wants an object to add its options to), false accepts none.
    if value is True:
        return {}
    if value is False:
        raise _bad(f"{param}: the schema is false: it accepts no value", param)
    return value


def _make(form: str, value: Any, param: str, limits: ServerLimits) -> StructuredOutput:
    try:
        if form == "json":
            return StructuredOutput.json_schema(_schema(value, param, limits), param)
        if form == "json_object":
            return StructuredOutput.json_object(param)
        return getattr(StructuredOutput, form)(value, param)
    except InvalidRequestError as e:
        raise _bad(str(e), param) from None


def _response_format(rf: Any, limits: ServerLimits) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("response_format must be an object with a string type", param)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _make("json_object", None, param, limits)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise _bad("response_format.json_schema must be an object", param)
        schema = js.get("schema")
        if schema is None:
            return _make("json_object", None, param, limits)  # OpenAI: a schema is optional
        return _make("json", schema, param, limits)
    raise _bad(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)", param
    )


# vLLM's options that change nothing here: one backend (no fallback), and JSON is generated
# without free whitespace already (grammars.py)
_NO_OP_OPTIONS = ("disable_fallback", "disable_any_whitespace")


def _form_given(form: str, value: Any, param: str) -> bool:
    """Whether ``structured_outputs.<form>`` asks for a constraint (None: not set)."""
    if value is None:
        return False
    if form == "json_object":  # (false: not set)
        if not isinstance(value, bool):
            raise _bad(f"{param} must be a boolean", param)
        return value
    if form == "json" and not isinstance(value, (dict, bool, str)):
        raise _bad(f"{param} must be a JSON schema (an object, a boolean or JSON text)", param)
    return True  # (regex, choice, grammar: their types are checked by StructuredOutput)


def _structured_outputs(so: Any, limits: ServerLimits) -> StructuredOutput | None:
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise _bad("structured_outputs must be an object", param)
    for key, value in so.items():
        where = field_path(param, key)
        if key == "structural_tag":
            if value is not None:
                raise _bad("structured_outputs.structural_tag is not supported", where)
        elif key in _NO_OP_OPTIONS:
            if value is not None and not isinstance(value, bool):
                raise _bad(f"{where} must be a boolean", where)
        elif key not in _FORMS:
            known = ", ".join((*_FORMS, *_NO_OP_OPTIONS))
            raise _bad(f"{where} is not a structured_outputs field (known: {known})", where)
    given = [f for f in _FORMS if _form_given(f, so.get(f), f"{param}.{f}")]
    if len(given) > 1:
        raise _bad(f"structured_outputs sets {', '.join(given)}: set one of them", param)
    if not given:
        return None
    form = given[0]
    return _make(form, so[form], f"{param}.{form}", limits)


def parse_structured(body: dict[str, Any], limits: ServerLimits) -> StructuredOutput | None:
    """The request's constraint, or None; 400 when fields conflict or are malformed."""
    found: list[StructuredOutput] = []
    for name in ("response_format", "structured_outputs", *_ALIASES):
        value = body.get(name)
        if value is None:
            continue
        check_depth(value, limits.max_json_depth, name)
        if name == "response_format":
            spec = _response_format(value, limits)
        elif name == "structured_outputs":
            spec = _structured_outputs(value, limits)
        else:
            spec = _make(_ALIASES[name], value, name, limits)
        if spec is not None:
            found.append(spec)
    if len(found) > 1:
        names = ", ".join(s.field for s in found)
        raise _bad(f"{names}: a request may set one structured output form", found[1].field)
    return found[0] if found else None
