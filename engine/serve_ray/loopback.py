"""Keep a local cluster on the loopback: what Ray's own settings do not cover.

``LocalRay.start`` makes the node IP 127.0.0.1, so Ray's processes bind there. One listener
is left: Ray Serve (2.60) starts each replica's inter-deployment gRPC server on ``[::]:0``,
every interface, whatever the node IP. A replica of a loopback-only cluster (``ENV`` set by
``LocalRay.start``, inherited by every Ray process) binds it on 127.0.0.1 instead; the other
replicas reach it at the node IP, which is 127.0.0.1 too.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ENV", "keep_replica_on_loopback"]

ENV = "LORAPLEX_RAY_LOOPBACK"
_WIDE = ("[::]:", "0.0.0.0:")


def keep_replica_on_loopback() -> bool:
    """In a replica process of a loopback-only cluster: later gRPC servers of Ray Serve's
    replica bind 127.0.0.1. Returns whether it applies (False: not asked, or Ray changed)."""
    if os.environ.get(ENV) != "1":
        return False
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:
        return False
    bind = getattr(serve_replica, "add_port_to_grpc_server", None)
    if bind is None:
        return False
    if getattr(bind, "loraplex_loopback", False):
        return True

    def bind_loopback(server: Any, address: str) -> int:
        if address.startswith(_WIDE):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return bind(server, address)

    bind_loopback.loraplex_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = bind_loopback
    return True
