"""Import layers of the installed package: no cycles between modules, no upward arrows.

Every module under engine/, resolvers/ and plugins/ is parsed (never imported) under the name
it installs as (``loraplex.engine...``, see setup.py). An arrow ``a -> b`` is any import
statement in ``a`` naming ``b``: at module level, inside functions, under ``TYPE_CHECKING``;
relative imports are resolved; ``from p import name`` is an arrow to ``p.name`` when that is a
module, else to ``p``. Imports by string (``importlib.import_module``, as the CLI's subcommand
registry does) are not arrows. Parent packages a submodule import runs implicitly are not
arrows either (every ``loraplex.engine.*`` import runs ``loraplex/engine/__init__.py``).

The layers, lowest first, are in ``LAYERS``: a module may import its own layer and the ones
below. A module's layer is the entry with the longest matching prefix.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {
    "engine": "loraplex.engine",
    "resolvers": "loraplex.resolvers",
    "plugins": "loraplex.plugins",
}

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # typed errors (the engine's and every adapter error), the frozen engine config and the
    # kernel-backend names it checks: shared by everything, they import nothing of ours but
    # each other
    (
        "leaves",
        ("loraplex.engine.errors", "loraplex.engine.config", "loraplex.engine.model.backend"),
    ),
    # the resolver contract (Resolver, ResolverSettings, FetchResult) and the source policy
    ("resolver contract", ("loraplex.resolvers.base", "loraplex.resolvers.policy")),
    # the plugin system: hookspecs typed with the contract, the manager, fetch_adapter
    ("plugin system", ("loraplex.plugins",)),
    # the built-in resolver plugins (local, huggingface, s3) and the loraplex.resolvers facade
    ("resolver plugins", ("loraplex.resolvers",)),
    # the model with its LoRA compute (model/lora/: layers, mapping, kernels and twins, the slot
    # image and the device half of a slot write) and KV blocks: nothing above them
    ("model", ("loraplex.engine.model", "loraplex.engine.kv")),
    # the adapter lifecycle: registry and versions, fetch, checks, staging, loader processes,
    # host pool, slot table and writer
    ("adapters", ("loraplex.engine.adapters",)),
    # the engine core: AsyncEngine, EngineCore, executor, scheduler, requests, runner, demo, ...
    ("core", ("loraplex.engine",)),
    # benchmark studies on the engine's API (``loraplex bench``); they never import the server
    ("studies", ("loraplex.engine.bench",)),
    # the HTTP server and the ``loraplex`` command line, which registers the studies
    ("server", ("loraplex.engine.server",)),
    # replicas on Ray Serve: an ingress on the server code, ``loraplex serve-ray``
    ("Ray front", ("loraplex.engine.serve_ray",)),
]

# Arrows on an import cycle today ("a -> b", short names without "loraplex."). The test fails
# when one of them no longer lies on a cycle: remove it here then, so the list only shrinks.
KNOWN_CYCLE_ARROWS: set[str] = set()
# Arrows from a lower layer to a higher one that are still allowed (same shrink rule).
KNOWN_UPWARD_ARROWS: set[str] = set()


def _short(name: str) -> str:
    return name.removeprefix("loraplex.")


def _arrow(a: str, b: str) -> str:
    return f"{_short(a)} -> {_short(b)}"


def find_modules(root: Path | None = None) -> dict[str, tuple[Path, bool]]:
    """Installed name -> (file, is a package), for every module setup.py installs."""
    root = root or ROOT
    found: dict[str, tuple[Path, bool]] = {}
    for top, dotted in TOP.items():
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root / top)
            dirs = [root / top / Path(*rel.parts[:i]) for i in range(len(rel.parts))]
            if not all((d / "__init__.py").is_file() for d in dirs):
                continue  # not in a package: not installed
            parts = list(rel.with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            found[".".join([dotted, *parts])] = (path, is_pkg)
    return found


def imports_of(
    source: str, name: str, is_pkg: bool, known: Iterable[str], filename: str = "<src>"
) -> set[str]:
    """The known modules that ``source`` (module ``name``) imports, anywhere in its body."""
    known = set(known)

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts:
            if ".".join(parts) in known:
                return ".".join(parts)
            parts.pop()
        return None

    package = name if is_pkg else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            targets.update(filter(None, (resolve(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                target = resolve(f"{module}.{alias.name}") or resolve(module)
                if target is not None:
                    targets.add(target)
    targets.discard(name)
    return targets


def import_graph(root: Path | None = None) -> dict[str, set[str]]:
    modules = find_modules(root)
    return {
        name: imports_of(path.read_text(encoding="utf-8"), name, is_pkg, modules, str(path))
        for name, (path, is_pkg) in modules.items()
    }


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def cycle_through(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    """A shortest cycle that takes the arrow a -> b (b back to a by breadth-first search)."""
    prev: dict[str, str | None] = {b: None}
    queue = deque([b])
    while queue:
        v = queue.popleft()
        if v == a:
            break
        for w in sorted(graph[v]):
            if w not in prev:
                prev[w] = v
                queue.append(w)
    path, v = [], a
    while v is not None:
        path.append(v)
        v = prev[v]
    return [a, *reversed(path)]


def cycle_arrows(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Every arrow that lies on a cycle -> one cycle through it."""
    found = {}
    for comp in strongly_connected(graph):
        members = set(comp)
        for a in comp:
            for b in sorted(graph[a] & members):
                found[_arrow(a, b)] = cycle_through(graph, a, b)
    return found


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def upward_arrows(graph: dict[str, set[str]]) -> dict[str, str]:
    """Arrows from a lower layer to a higher one -> "layer -> layer"."""
    found = {}
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a), layer_of(b)
            if lb > la:
                found[_arrow(a, b)] = f"{LAYERS[la][0]} -> {LAYERS[lb][0]}"
    return found


def _report(title: str, lines: Iterable[str]) -> str:
    return "\n".join([title, *(f"  {line}" for line in sorted(lines))])


# -- the tests ------------------------------------------------------------------------------------


def test_every_module_is_parsed_and_placed() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "loraplex.engine.server.cli" in graph
    # the CLI registers the studies from inside a function
    assert "loraplex.engine.bench.coldload.cli" in graph["loraplex.engine.server.cli"]
    unplaced = [m for m in graph if layer_of(m) < 0]
    assert not unplaced, _report("modules in no layer of LAYERS:", unplaced)


def test_imports_of_resolves_relative_and_from_imports() -> None:
    known = {"loraplex.a", "loraplex.a.b", "loraplex.a.b.c", "loraplex.a.d", "loraplex.e"}
    src = (
        "from . import c\n"
        "from .. import d\n"
        "from ..d import Thing\n"
        "import loraplex.e as e\n"
        "def f():\n"
        "    from loraplex.a.b.c import g\n"
        "if TYPE_CHECKING:\n"
        "    from loraplex.a import missing\n"
        "import numpy\n"
    )
    assert imports_of(src, "loraplex.a.b.x", False, known) == {
        "loraplex.a.b.c", "loraplex.a.d", "loraplex.e", "loraplex.a",
    }  # fmt: skip
    assert imports_of("from .c import z\n", "loraplex.a.b", True, known) == {"loraplex.a.b.c"}


def test_no_new_import_cycles() -> None:
    graph = import_graph()
    found = cycle_arrows(graph)
    new = {arrow: path for arrow, path in found.items() if arrow not in KNOWN_CYCLE_ARROWS}
    gone = KNOWN_CYCLE_ARROWS - found.keys()
    lines = []
    if new:
        lines.append(
            _report(
                "new import cycles (arrow: one cycle through it):",
                (f"{a}:  {' -> '.join(map(_short, p))}" for a, p in new.items()),
            )
        )
    if gone:
        lines.append(_report("no longer on a cycle: remove from KNOWN_CYCLE_ARROWS:", gone))
    comps = strongly_connected(graph)
    lines.append(
        _report(
            "cycles (strongly connected modules) now:", (" ".join(map(_short, c)) for c in comps)
        )
    )
    assert not new and not gone, "\n".join(lines)


def test_no_upward_imports() -> None:
    found = upward_arrows(import_graph())
    new = {a: why for a, why in found.items() if a not in KNOWN_UPWARD_ARROWS}
    gone = KNOWN_UPWARD_ARROWS - found.keys()
    lines = []
    if new:
        lines.append(_report("imports of a higher layer:", (f"{a}  ({w})" for a, w in new.items())))
    if gone:
        lines.append(_report("no longer upward: remove from KNOWN_UPWARD_ARROWS:", gone))
    assert not new and not gone, "\n".join(lines)


def layers_in_docs(path: Path | None = None) -> list[tuple[str, tuple[str, ...]]]:
    """The "Import layers" table of docs/architecture.md: (layer, its modules' installed
    names), from the first two columns (backticked paths under engine/, resolvers/,
    plugins/; a folder is its package, a .py file its module)."""
    text = (path or ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Import layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        names = []
        for token in re.findall(r"`([^`]+)`", cells[1]):
            top, _, rest = token.partition("/")
            if top not in TOP:
                continue  # a folder named relative to another (``model/lora/``), a command
            parts = [p for p in rest.removesuffix(".py").split("/") if p]
            names.append(".".join([TOP[top], *parts]))
        rows.append((cells[0], tuple(names)))
    return rows


def test_the_docs_layer_table_is_layers() -> None:
    """docs/architecture.md's layer table and ``LAYERS`` name the same layers, in the same
    order, with the same folders and modules."""
    assert layers_in_docs() == LAYERS


def test_imports_of_test_modules_finds_them(tmp_path: Path) -> None:
    """The check below finds ``from tests.x.test_y import`` and ``from tests.x.conftest
    import`` (also ``import tests.x.test_y``, inside functions) and nothing else."""
    (tmp_path / "a.py").write_text(
        "from tests.helpers.engine import config\nimport tests.helpers.models\n"
        "def f():\n    from tests.engine.test_pipelined import running\n"
        "import tests.server.conftest as c\nfrom tests.structured.forms import FORMS\n"
    )
    assert imports_of_test_modules([tmp_path]) == [
        f"{tmp_path / 'a.py'}:4: tests.engine.test_pipelined",
        f"{tmp_path / 'a.py'}:5: tests.server.conftest",
    ]


def imports_of_test_modules(roots: Iterable[Path]) -> list[str]:
    """Imports of a test module (``test_*``, ``conftest``) under ``tests.`` in the files of
    ``roots``: "path:line: module"."""
    found: list[tuple[Path, int, str]] = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    last = name.rsplit(".", 1)[-1]
                    if name.startswith("tests.") and (
                        last.startswith("test_") or last == "conftest"
                    ):
                        found.append((path, node.lineno, name))
    return [f"{path}:{line}: {name}" for path, line, name in sorted(found)]


def test_no_test_module_imports_another() -> None:
    """Helpers shared between test modules live in helper modules (tests/helpers/, or a
    folder's own such as tests/structured/forms.py); no file of tests/ or benchmarks/ imports
    a test module or a conftest (pytest loads those itself: fixtures go through conftest.py
    and ``pytest_plugins``)."""
    found = imports_of_test_modules([ROOT / "tests", ROOT / "benchmarks"])
    assert not found, _report("imports of a test module:", found)
