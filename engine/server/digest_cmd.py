"""``loraplex digest DIR|URI``: print an adapter's content digest (DESIGN.md "Identity").

A local folder is hashed in place. A remote URI (``hf://``, ``s3://``, plugin schemes) is
fetched with the resolvers into a temporary folder first; the URI given on the command line is
the operator's own choice, so it is allowed verbatim.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loraplex.engine.server.subcommand import Subcommand

__all__ = ["COMMAND", "local_folder"]


def local_folder(source: str) -> Path | None:
    """The folder a plain path or ``file://`` URI names; None for remote URIs."""
    if "://" not in source:
        return Path(source)
    parts = urlsplit(source)
    if parts.scheme.lower() == "file" and parts.netloc in ("", "localhost"):
        return Path(unquote(parts.path))
    return None


async def _remote_digest(uri: str, plugins: list[str] | None) -> tuple[str, str]:
    from loraplex.engine.adapters.digest import adapter_digest_async
    from loraplex.plugins.manager import PluginManager
    from loraplex.resolvers import ResolverSettings, SourcePolicy, fetch_adapter

    policy = SourcePolicy().allowing([uri])
    manager = PluginManager(plugins, ResolverSettings(policy=policy))
    with tempfile.TemporaryDirectory(prefix="loraplex-digest-") as tmp:
        result = await fetch_adapter(uri, Path(tmp) / "adapter", manager=manager, policy=policy)
        return await adapter_digest_async(result.local_dir), result.pinned_uri


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="DIR|URI", help="adapter folder, file:// hf:// or s3:// URI")
    p.add_argument(
        "--plugins",
        default=None,
        help="comma-separated resolver plugins for remote URIs (default: the built-in ones)",
    )


def run(args: argparse.Namespace) -> int:
    from loraplex.engine.adapters.digest import adapter_digest
    from loraplex.engine.logging import configure_logging

    configure_logging("warning")  # stdout carries the digest only

    folder = local_folder(args.source)
    try:
        if folder is not None:
            if not folder.is_dir():
                print(f"loraplex digest: {folder} is not a folder", file=sys.stderr)
                return 1
            print(adapter_digest(folder))
            return 0
        plugins = [p for p in args.plugins.split(",") if p] if args.plugins else None
        digest, pinned = asyncio.run(_remote_digest(args.source, plugins))
    except Exception as e:  # noqa: BLE001 - typed adapter / plugin errors: one clear line
        print(f"loraplex digest: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if pinned != args.source:
        print(f"# fetched {pinned}", file=sys.stderr)
    print(digest)
    return 0


COMMAND = Subcommand(
    name="digest",
    help="print an adapter's sha256 content digest",
    description=(
        "Print sha256 of what `sha256sum adapter_config.json adapter_model.safetensors` prints "
        "in the adapter folder (the value --lora-modules' sha256 expects)."
    ),
    add_arguments=add_arguments,
    run=run,
)
