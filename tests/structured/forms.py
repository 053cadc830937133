"""The constraint forms the structured-output tests run, and how an output is validated."""

from __future__ import annotations

import json
import re
from typing import Any

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
