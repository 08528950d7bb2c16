"""The import rule of docs/ARCHITECTURE.md, checked on the source (no imports are executed).

Stages import only earlier stages and the shared layers: packing -> training -> evaluation, with
analysis beside training (it uses models and packing only); the shared layers (config, io,
manifest, tracking, process, attention, models) import no stage. Library code never imports
Prefect (only tasks/ and flows/ do) and never imports the demo generators (only the entry
points do: the commands, the Prefect tasks and flows, the CLI). Every import counts, at module
top or inside a function, since a function-local import is an edge all the same.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import anchorctx

ROOT = Path(anchorctx.__file__).resolve().parent
SHARED = {"config", "io", "manifest", "tracking", "process", "attention", "models"}
STAGES = {"packing", "training", "evaluation", "analysis"}
# What each part of the package may import from anchorctx (its own part always).
ALLOWED = {
    "io": set(),
    "config": {"io"},
    "manifest": {"config", "io"},
    "process": set(),
    "tracking": {"config", "io", "manifest"},
    "attention": {"config", "io"},
    "models": {"config", "io", "attention"},
    "packing": {"config", "io", "manifest", "attention", "models"},
    "training": {"config", "io", "manifest", "tracking", "process", "attention", "models",
                 "packing"},
    "analysis": {"config", "io", "manifest", "attention", "models", "packing"},
    "evaluation": {"config", "io", "manifest", "tracking", "process", "attention", "models",
                   "packing", "training", "analysis"},
    "demo": SHARED | STAGES,
    "tasks": SHARED | STAGES | {"demo", "tasks"},
    "flows": SHARED | STAGES | {"demo", "tasks"},
    "cli": SHARED | STAGES | {"flows"},
    "__main__": {"cli"},
    "__init__": set(),
}  # fmt: skip
# Entry points run a stage from the command line: they may also write demo inputs first and
# turn errors into the CLI's one-line form.
ENTRY_EXTRA = {"demo", "cli"}
ENTRY_FILES = {"commands.py", "worker.py"}


def _part(module: str) -> str:
    """``anchorctx.training.loop`` -> ``training``; ``anchorctx.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; for __init__.py the package itself
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this file's package
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
    return out


def forbidden_edges() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        own = rel.parts[0].removesuffix(".py")
        allowed = ALLOWED[own] | {own}
        if path.name in ENTRY_FILES:
            allowed = allowed | ENTRY_EXTRA
        for line, module in _imports(path):
            where = f"anchorctx/{rel.as_posix()}:{line} imports {module}"
            top = module.split(".")[0]
            if top == "prefect" and own not in {"tasks", "flows"}:
                found.append(f"{where} (only tasks/ and flows/ may import Prefect)")
            elif top == "anchorctx" and module != "anchorctx" and _part(module) not in allowed:
                found.append(f"{where} ({own} may import only {sorted(allowed)})")
    return found


def test_no_forbidden_import_edges():
    assert forbidden_edges() == []


def test_the_rule_sees_a_forbidden_edge(tmp_path, monkeypatch):
    """The check is not vacuous: a packing module importing training is reported."""
    pkg = tmp_path / "anchorctx"
    (pkg / "packing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "packing" / "bad.py").write_text(
        "def f():\n    from anchorctx.training.loop import train\n    import prefect\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    found = forbidden_edges()
    assert len(found) == 2
    assert "packing/bad.py:2 imports anchorctx.training.loop" in found[0]
    assert "Prefect" in found[1]
