"""Structured output: grammar-constrained decoding per request (JSON schema, regex, choice,
grammar), compiled with llguidance off the step thread and applied as per-row token bitmasks.

``spec``: what a request asks for (``StructuredOutput``); ``grammars``: compiling and caching
(``GrammarCache``), one ``Guide`` (the matcher) per request; ``bitmask``: filling the step's
masks on the host and applying them to the logits on the device in one launch.
"""

from __future__ import annotations

from loraplex.engine.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
