"""Which adapter sources the operator allows.

Remote URIs (``hf://``, ``s3://``, plugin schemes) must match an allowlist glob (fnmatch, case
sensitive, ``*`` also matches ``/``) or be one of the exact URIs the operator configured.
Local sources (``file://`` URIs and plain paths) must lie under an operator root, checked on
the real path (``os.path.realpath``), so ``..`` and symlinks cannot escape. Allow patterns do
not apply to local sources: the roots are their allowlist. A local source the operator
configured one by one (``allowing``: ``--lora-modules``, static registrations) is a root of its
own, kept as the real path it had when it was allowed (a set: a check looks up the candidate's
ancestors, so its cost does not grow with the number of registered adapters). The check alone
does not stop a path from changing after it (a directory swapped for a symlink): the local
resolver opens the checked real path component by component without following links
(resolvers/local.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loraplex.engine.errors import AdapterPolicyError, AdapterSourceError

__all__ = ["SourcePolicy", "scheme_of", "is_local", "local_path_of"]

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f\\?#]")  # controls, whitespace, backslash, query, fragment


def scheme_of(uri: str) -> str:
    """Lower-case URI scheme; a plain path (no ``scheme://``) is ``file``."""
    m = _SCHEME_RE.match(uri)
    return m.group(1).lower() if m else "file"


def is_local(uri: str) -> bool:
    return scheme_of(uri) == "file"


def local_path_of(uri: str) -> str:
    """The absolute path a ``file://`` URI or plain path names (not yet resolved)."""
    if _SCHEME_RE.match(uri):
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise AdapterPolicyError(f"file URI {uri!r} names a remote host", field="uri")
        path = unquote(parts.path)
    else:
        path = uri
    if not path or "\x00" in path:
        raise AdapterPolicyError(f"local adapter path {uri!r} is empty or invalid", field="uri")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:  # e.g. a lone surrogate from a JSON body: no file has that name
        raise AdapterPolicyError(
            f"local adapter path {uri!r} cannot be a file name (not encodable)", field="uri"
        ) from None
    if ".." in Path(path).parts:
        raise AdapterPolicyError(f"local adapter path {uri!r} contains '..'", field="uri")
    return os.path.abspath(os.path.expanduser(path))


def _realpath(path: str | Path) -> str:
    try:
        return os.path.realpath(path)
    except OSError as e:  # a component changed between lstat and readlink
        raise AdapterSourceError(
            f"local path {str(path)!r} changed while it was being resolved: {e}", field="uri"
        ) from None


def _inside(path: str, root: str) -> bool:
    return path == root or os.path.commonpath([path, root]) == root


@dataclass(frozen=True)
class SourcePolicy:
    """Operator allowlist of adapter sources; the default allows nothing (fail closed)."""

    allow: Sequence[str] = ()  # fnmatch patterns over remote URIs
    local_roots: Sequence[Path | str] = ()  # operator roots, resolved at each check
    exact: frozenset[str] = field(default_factory=frozenset)  # remote URIs allowed verbatim
    # real paths of local sources allowed one by one (each a root of its own)
    local_dirs: frozenset[str] = field(default_factory=frozenset)

    def allowing(self, uris: Iterable[str]) -> SourcePolicy:
        """A copy that also allows these operator-configured URIs (e.g. ``--lora-modules``).

        Remote URIs are allowed verbatim; a local directory becomes a root of its own, at its
        real path now (touches the disk: call it off the event loop)."""
        dirs, exact = set(self.local_dirs), set(self.exact)
        for uri in uris:
            if is_local(uri):
                dirs.add(_realpath(local_path_of(uri)))
            else:
                exact.add(uri)
        return replace(self, exact=frozenset(exact), local_dirs=frozenset(dirs))

    def union(self, other: SourcePolicy) -> SourcePolicy:
        """What either policy allows (``other``'s one-by-one sources added to this one's)."""
        return replace(
            self,
            allow=tuple(dict.fromkeys([*self.allow, *other.allow])),
            local_roots=tuple(dict.fromkeys([*self.local_roots, *other.local_roots])),
            exact=self.exact | other.exact,
            local_dirs=self.local_dirs | other.local_dirs,
        )

    def check(self, uri: str) -> None:
        """Raise AdapterPolicyError unless ``uri`` is allowed (touches the disk for local URIs)."""
        if is_local(uri):
            self.local_path(uri)
            return
        _check_remote_syntax(uri)
        if uri in self.exact or any(fnmatchcase(uri, pat) for pat in self.allow):
            return
        raise AdapterPolicyError(
            f"adapter source {uri!r} matches no allowed source pattern", field="uri"
        )

    def real_roots(self) -> list[str]:
        return [_realpath(os.path.abspath(os.path.expanduser(r))) for r in self.local_roots]

    def real_path(self, path: str | Path) -> str:
        """``os.path.realpath``, with a typed error when the path changes while it is resolved
        (e.g. ``readlink`` of a link that was just swapped back for a directory: EINVAL)."""
        return _realpath(path)

    def contains(self, path: str | Path) -> bool:
        """Whether the real path of ``path`` lies under one of the local roots."""
        return self.contains_real(_realpath(path))

    def contains_real(self, real: str) -> bool:
        """Whether ``real``, already a real path, lies under one of the local roots."""
        return self.root_of(real) is not None

    def root_of(self, real: str) -> str | None:
        """The real path of the innermost local root that holds ``real`` (a real path)."""
        roots = [r for r in self.real_roots() if _inside(real, r)]
        if self.local_dirs:
            # the innermost one-by-one root: the first ancestor (or ``real``) in the set
            path = real
            while True:
                if path in self.local_dirs:
                    roots.append(path)
                    break
                parent = os.path.dirname(path)
                if parent == path:
                    break
                path = parent
        return max(roots, key=len) if roots else None

    def local_path(self, uri: str) -> Path:
        """The real path of a local source, after checking it lies under a root."""
        path = local_path_of(uri)
        if not self.local_roots and not self.local_dirs:
            raise AdapterPolicyError(
                f"local adapter source {uri!r} refused: no local roots are configured", field="uri"
            )
        real = _realpath(path)
        if self.root_of(real) is None:
            via = "" if real == path else f" (it resolves to {real!r})"
            raise AdapterPolicyError(
                f"local adapter source {uri!r} is outside the allowed roots{via}", field="uri"
            )
        return Path(real)


def _check_remote_syntax(uri: str) -> None:
    m = _SCHEME_RE.match(uri)
    if m is None:
        raise AdapterSourceError(f"adapter source {uri!r} is not a URI", field="uri")
    rest = uri[m.end() :]
    if _BAD_CHARS.search(rest):
        raise AdapterPolicyError(
            f"adapter source {uri!r} contains whitespace, control characters, '\\', '?' or '#'",
            field="uri",
        )
    segments = rest.rstrip("/").split("/")
    if any(s in ("", ".", "..") for s in segments):
        raise AdapterPolicyError(
            f"adapter source {uri!r} has an empty, '.' or '..' path segment", field="uri"
        )
