"""Built-in resolver plugins (local, huggingface, s3) and the resolver contract (with the
typed errors a resolver raises, from ``loraplex.engine.errors``).

The concrete resolvers are imported lazily, through the ``loraplex.plugins`` entry points, so
importing this package does not pull in huggingface_hub or s3fs. ``fetch_adapter`` belongs to
the plugin manager (``loraplex.plugins.manager``), which sits above the contract; it is
re-exported here on first use, since the manager imports ``loraplex.resolvers.base`` (and so
this package) while it loads.
"""

from __future__ import annotations

from typing import Any

from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterNotFoundError,
    AdapterPolicyError,
    AdapterSourceError,
    AdapterTooLargeError,
)
from loraplex.resolvers.base import (
    ADAPTER_FILES,
    TOKENIZER_FILES,
    AdapterSource,
    FetchResult,
    ProgressCallback,
    Report,
    Resolver,
    ResolverSettings,
    copy_file,
)
from loraplex.resolvers.policy import SourcePolicy, scheme_of

__all__ = [
    # the errors a resolver raises (the resolver contract names them)
    "AdapterConfigError",
    "AdapterFormatError",
    "AdapterNotFoundError",
    "AdapterPolicyError",
    "AdapterSourceError",
    "AdapterTooLargeError",
    "ADAPTER_FILES",
    "TOKENIZER_FILES",
    "AdapterSource",
    "FetchResult",
    "ProgressCallback",
    "Report",
    "Resolver",
    "ResolverSettings",
    "SourcePolicy",
    "copy_file",
    "fetch_adapter",
    "scheme_of",
]


def __getattr__(name: str) -> Any:
    if name == "fetch_adapter":
        from loraplex.plugins.manager import fetch_adapter

        return fetch_adapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
