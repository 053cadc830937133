"""Built-in resolver plugins (local, huggingface, s3) and the resolver contract.

The concrete resolvers are imported lazily, through the ``loraplex.plugins`` entry points, so
importing this package does not pull in huggingface_hub or s3fs.
"""

from __future__ import annotations

from loraplex.resolvers.base import (
    ADAPTER_FILES,
    AdapterSource,
    FetchResult,
    ProgressCallback,
    Report,
    Resolver,
    ResolverSettings,
    copy_file,
    fetch_adapter,
)
from loraplex.resolvers.policy import SourcePolicy, scheme_of

__all__ = [
    "ADAPTER_FILES",
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
