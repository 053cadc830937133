"""What a request constrains its output to: ``StructuredOutput``.

Kinds (vLLM's ``structured_outputs`` names): ``json`` (a JSON schema), ``json_object`` (any JSON
object), ``regex``, ``choice`` (one of a list of strings), ``grammar`` (Lark, or GBNF / EBNF as
llama.cpp writes it). ``value`` is the canonical text of the constraint (the schema as compact
JSON, keys in the given order; the choices as a JSON list), so equal constraints share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.structured.schema_check import check_schema

__all__ = ["StructuredOutput", "KINDS"]

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    value: str = ""
    # the request field that asked for it: errors name it (not part of the constraint)
    field: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}",
                field=self.field,
            )
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"{self.field} must be text", field=self.field)
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError(f"{self.field} must not be empty", field=self.field)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by (with the tokenizer)."""
        return (self.kind, self.value)

    @classmethod
    def json_schema(cls, schema: Any, field: str = "structured_outputs") -> StructuredOutput:
        """A JSON schema given as an object or as JSON text (booleans are schemas too)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(
                    f"{field}: the schema is not valid JSON: {e}", field=field
                ) from None
            except RecursionError:
                raise InvalidRequestError(
                    f"{field}: the schema is nested too deep", field=field
                ) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{field}: a JSON schema must be an object", field=field)
        check_schema(schema, field)  # inputs known to crash the grammar library or mislead it
        # (key order kept: it is the order the properties are generated in)
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except RecursionError:
            raise InvalidRequestError(
                f"{field}: the schema is nested too deep", field=field
            ) from None
        except ValueError as e:
            raise InvalidRequestError(
                f"{field}: the schema is not valid JSON: {e}", field=field
            ) from None
        return cls("json", text, field)

    @classmethod
    def json_object(cls, field: str = "structured_outputs") -> StructuredOutput:
        return cls("json_object", "", field)

    @classmethod
    def regex(cls, pattern: Any, field: str = "structured_outputs") -> StructuredOutput:
        if not isinstance(pattern, str):
            raise InvalidRequestError(f"{field} must be a string", field=field)
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, options: Any, field: str = "structured_outputs") -> StructuredOutput:
        if (
            not isinstance(options, list)
            or not options
            or not all(isinstance(o, str) and o for o in options)
        ):
            raise InvalidRequestError(
                f"{field} must be a non-empty list of non-empty strings", field=field
            )
        return cls("choice", json.dumps(options, ensure_ascii=False), field)

    @classmethod
    def grammar(cls, text: Any, field: str = "structured_outputs") -> StructuredOutput:
        if not isinstance(text, str):
            raise InvalidRequestError(f"{field} must be a string", field=field)
        return cls("grammar", text, field)
