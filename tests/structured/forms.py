"""The constraint forms the structured-output tests run, and how an output is validated."""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.engine.structured import StructuredOutput
from loraplex.engine.structured.grammars import grammar_text

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "address", "age"],
    "additionalProperties": False,
}
ENUM = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "in_stock": {"type": "boolean"},
    },
    "required": ["color", "size", "in_stock"],
    "additionalProperties": False,
}
ARRAY = {
    "type": "object",
    "properties": {
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 4,
        },
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "maxItems": 5,
        },
    },
    "required": ["tags", "scores"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2,4}"
# the decode benchmark's schema: short bounded strings, too many to end inside its window
LONG = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1000}
CHOICES = ["positive", "negative", "neutral"]

# name -> (form, constraint): form is a structured_outputs key
FORMS: dict[str, tuple[str, Any]] = {
    "json_object": ("json_object", True),
    "nested": ("json", NESTED),
    "enum": ("json", ENUM),
    "array": ("json", ARRAY),
    "regex": ("regex", REGEX),
    "choice": ("choice", CHOICES),
}


def check(name: str, text: str) -> None:
    """Raise unless ``text`` is a valid output of form ``name``."""
    form, value = FORMS[name]
    if form == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif form == "json":
        import jsonschema  # here: the mask tests import the forms where it is not installed

        jsonschema.validate(json.loads(text), value)
    elif form == "regex":
        assert re.fullmatch(value, text), text
    else:
        assert text in value, text


# Tools: WEATHER and TIME_ANY as a client sends them; BOUNDED and TIME with bounded arguments
# (the server's tool tests), MESSAGES a question that calls for WEATHER.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME_ANY = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
BOUNDED = {"type": "function", "function": {**WEATHER["function"], "parameters": PARAMS}}
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
TIME = {"type": "function", "function": {**TIME_ANY["function"], "parameters": NO_ARGS}}


def spec(name: str) -> StructuredOutput:
    """The request form of ``FORMS[name]``."""
    form, value = FORMS[name]
    if form == "json_object":
        return StructuredOutput.json_object()
    if form == "json":
        return StructuredOutput.json_schema(value)
    return getattr(StructuredOutput, form)(value)


def assert_prefix(engine, s: StructuredOutput, tokens: list[int]) -> None:
    """``tokens`` are a valid prefix of an output constrained by ``s`` (the engine's own compile)."""
    matcher = engine._core().grammars.compile(grammar_text(s))
    assert matcher.consume_tokens(tokens), matcher.get_error()
