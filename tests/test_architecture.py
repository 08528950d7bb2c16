"""The import rules of docs/ARCHITECTURE.md, checked on the source (no imports are executed).

Stages import only earlier stages and the shared layers: packing -> training -> evaluation, with
analysis beside training (it uses models and packing only); the shared layers (config,
experiment, io, manifest, tracking, process, attention, models) import no stage. Library code
never imports Prefect (only tasks/ and flows/ do) and never imports the demo generators (only
the entry points do: the commands, the Prefect tasks and flows, the CLI). Every import counts, at
module top or inside a function, since a function-local import is an edge all the same.

The config is layered on its own: ``config`` is the mechanism (schema base, field types, YAML and
overrides) and imports only io; each section's schema is a ``settings`` module beside its owner
(``anchorctx/<part>/settings.py``, ``anchorctx/tracking_settings.py``) that imports only config,
io and ``attention.names``; ``experiment`` is the root schema and may import config, io, the
settings modules and the checkpoint layout (``models.checkpoints``). A settings module is
importable by the root and by whatever may import its owner.

No import cycles between library modules either (see :func:`import_cycles` for what counts).
"""

from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

import anchorctx

ROOT = Path(anchorctx.__file__).resolve().parent
SHARED = {"config", "experiment", "io", "manifest", "tracking", "process", "attention", "models"}
SHARED |= {"errors"}  # one line and an exit status for an error (the CLI, the training ranks)
STAGES = {"packing", "training", "evaluation", "analysis"}
# What each part of the package may import from anchorctx (its own part always, except for the
# settings modules). An entry is a part, a layer (``settings``), or a dotted module below
# anchorctx that allows that module and its submodules only (``attention.names``).
ALLOWED = {
    "io": set(),
    "errors": set(),  # one line and an exit status for an error: the CLI and the training ranks
    "lazy": set(),  # PEP 562 package exports; every part may use it (`from anchorctx import lazy`)
    "config": {"io"},
    "settings": {"config", "io", "attention.names"},
    "experiment": {"config", "io", "settings", "models.checkpoints"},
    "manifest": {"config", "experiment", "io"},
    "process": set(),
    "tracking": {"config", "experiment", "io", "manifest"},
    "attention": {"config", "io"},
    "models": {"config", "experiment", "io", "attention"},
    "packing": {"config", "experiment", "io", "manifest", "attention", "models"},
    "training": {
        "config",
        "experiment",
        "io",
        "manifest",
        "tracking",
        "process",
        "attention",
        "models",
        "packing",
    },
    "analysis": {"config", "experiment", "io", "manifest", "attention", "models", "packing"},
    "evaluation": {
        "config",
        "experiment",
        "io",
        "manifest",
        "tracking",
        "process",
        "attention",
        "models",
        "packing",
        "training",
        "analysis",
    },
    "demo": SHARED | STAGES,
    "tasks": SHARED | STAGES | {"demo", "tasks"},
    "flows": SHARED | STAGES | {"demo", "tasks"},
    "cli": SHARED | STAGES | {"flows", "demo"},
    "__main__": {"cli"},
    "__init__": set(),
}
# Entry points run a stage from the command line: they may also write demo inputs first and
# turn errors into the CLI's one-line form.
ENTRY_EXTRA = {"demo", "cli", "errors"}
ENTRY_FILES = {"commands.py", "worker.py"}
# Settings modules outside a ``<part>/settings.py`` file, and the part that owns each.
SETTINGS_MODULES = {"anchorctx.tracking_settings": "tracking"}


def _part(module: str) -> str:
    """``anchorctx.training.loop`` -> ``training``; ``anchorctx.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> tuple[str, str]:
    """(layer, owning part): ``("settings", "packing")`` for ``anchorctx.packing.settings``,
    else the part twice."""
    if module in SETTINGS_MODULES:
        return "settings", SETTINGS_MODULES[module]
    parts = module.split(".")
    if len(parts) == 3 and parts[2] == "settings":
        return "settings", parts[1]
    return _part(module), _part(module)


def _may_import(allowed: set[str], module: str) -> bool:
    layer, owner = _layer(module)
    inner = module.removeprefix("anchorctx.")
    return (
        layer in allowed
        or owner in allowed
        or any(inner == entry or inner.startswith(entry + ".") for entry in allowed if "." in entry)
    )


def _module_name(path: Path) -> str:
    """``anchorctx/training/loop.py`` -> ``anchorctx.training.loop``; a package's ``__init__.py``
    -> the package."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, *, type_checking: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement below ``tree``; without ``type_checking``, none of those in the
    body of an ``if TYPE_CHECKING:`` block (its ``else:`` branch still runs)."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif not type_checking and _is_type_checking(node):
            stack += node.orelse  # type: ignore[attr-defined]
            continue
        stack += ast.iter_child_nodes(node)
    return sorted(out, key=lambda n: n.lineno)


def _from_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from X import ...`` (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; for __init__.py the package itself
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file."""
    out = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking=True):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        else:
            out.append((node.lineno, _from_module(path, node)))
    return out


def forbidden_edges() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        layer, own = _layer(_module_name(path))
        # A settings module is light by rule: its own package's code is not allowed to it.
        allowed = ALLOWED[layer] if layer == "settings" else ALLOWED[own] | {own}
        if path.name in ENTRY_FILES:
            allowed = allowed | ENTRY_EXTRA
        for line, module in _imports(path):
            where = f"anchorctx/{rel.as_posix()}:{line} imports {module}"
            top = module.split(".")[0]
            if top == "prefect" and own not in {"tasks", "flows"}:
                found.append(f"{where} (only tasks/ and flows/ may import Prefect)")
            elif top == "anchorctx" and module != "anchorctx" and not _may_import(allowed, module):
                found.append(f"{where} ({layer} may import only {sorted(allowed)})")
    return found


def test_no_forbidden_import_edges():
    assert forbidden_edges() == []


def test_the_rule_sees_a_forbidden_edge(tmp_path, monkeypatch):
    """The check is not vacuous: a packing module importing training is reported, and so is a
    settings module importing its own package's code."""
    pkg = tmp_path / "anchorctx"
    (pkg / "packing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "packing" / "bad.py").write_text(
        "def f():\n    from anchorctx.training.loop import train\n    import prefect\n"
    )
    (pkg / "packing" / "settings.py").write_text(
        "from anchorctx.attention.names import VARIANTS\nfrom anchorctx.packing import pack\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    found = forbidden_edges()
    assert len(found) == 3
    assert "packing/bad.py:2 imports anchorctx.training.loop" in found[0]
    assert "Prefect" in found[1]
    assert "packing/settings.py:2 imports anchorctx.packing" in found[2]


# ------------------------------------------------------------------------------ import cycles
def import_graph() -> dict[str, dict[str, tuple[str, int]]]:
    """module -> {imported module: (file, line)} over the package's own modules.

    What is an edge: every import, at module top or inside a function, except those in an
    ``if TYPE_CHECKING:`` block (they never run). ``from pkg import name`` is an edge to
    ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``). Loading a submodule
    first runs its package's ``__init__``: that implicit load is not an edge, or every
    ``__init__`` that re-exports its submodules would form a cycle with each of them. A
    submodule importing a name from its own package's ``__init__`` is an explicit edge and does
    count: the package is half-initialised while its ``__init__`` imports that submodule. Lazy
    exports (PEP 562 ``__getattr__`` over importlib) are no edge: they load on first attribute
    access, once every module involved has finished initialising.
    """
    files = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, dict[str, tuple[str, int]]] = {}
    for module, path in files.items():
        edges: dict[str, tuple[str, int]] = {}
        where = path.relative_to(ROOT.parent).as_posix()
        for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking=False):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _from_module(path, node)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for target in targets:
                if target in files and target != module:
                    edges.setdefault(target, (where, node.lineno))
        graph[module] = edges
    return graph


def _components(graph: dict[str, dict[str, tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _shortest_cycle(graph: dict[str, dict[str, tuple[str, int]]], start: str, within: set[str]):
    """The shortest path start -> ... -> start inside one component (breadth first)."""
    before: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w not in within:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(before[path[-1]])
                return [*reversed(path), start]
            if w not in before:
                before[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle")  # unreachable for a component's member


def import_cycles() -> list[str]:
    """One line per group of modules that import each other: a shortest cycle through the
    group's first module, with the file and line of each edge."""
    graph = import_graph()
    lines = []
    for component in _components(graph):
        cycle = _shortest_cycle(graph, component[0], set(component))
        short = [m.removeprefix("anchorctx.") for m in cycle]
        sites = ", ".join(
            f"{graph[a][b][0]}:{graph[a][b][1]}" for a, b in itertools.pairwise(cycle)
        )
        line = f"{' -> '.join(short)} ({sites})"
        if len(component) > len(cycle) - 1:
            line += f"; the group also holds {', '.join(sorted(set(component) - set(cycle)))}"
        lines.append(line)
    return lines


def test_no_import_cycles():
    assert import_cycles() == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The check is not vacuous: a -> b -> a is reported (b's import inside a function counts),
    while an ``__init__`` re-exporting its submodule and a TYPE_CHECKING import are not."""
    pkg = tmp_path / "anchorctx"
    (pkg / "p").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "p" / "__init__.py").write_text("from anchorctx.p.c import C\n")
    (pkg / "p" / "a.py").write_text("from anchorctx.p import b\n")
    (pkg / "p" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "p" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from anchorctx.p import C\n"
        "from anchorctx.p import a\nC = 1\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert import_cycles() == ["p.a -> p.b -> p.a (anchorctx/p/a.py:1, anchorctx/p/b.py:2)"]
