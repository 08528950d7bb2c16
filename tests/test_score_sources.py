"""What invalidates a cached score: the code version of ``results.SCORE_SOURCES`` alone.

Every source file under ``results.SCORE_SCOPE`` (evaluation/, models/) is classified, as able to
change a score or not; an edit to a report-only file keeps the evaluation's code version (and
so every cached result), an edit to a suite changes it. Offline, no model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import anchorctx
from anchorctx.evaluation import results
from anchorctx.manifest import SOURCE_PATTERNS, code_version

ROOT = Path(anchorctx.__file__).resolve().parent
# Files that only read, compare or report results (the report side of the evaluation).
REPORT_ONLY = (
    "evaluation/report.py",
    "evaluation/paired.py",
    "evaluation/arm_comparison.py",
    "evaluation/seed_pairs.py",
    "evaluation/tracking.py",
    "evaluation/averaging.py",
)


def _covered(rel: str, entries: tuple[str, ...]) -> bool:
    return any(rel == e or rel.startswith(e + "/") for e in entries)


def unclassified(root: Path) -> list[str]:
    """Source files under ``SCORE_SCOPE`` of the package at ``root`` in neither list."""
    found = {
        p.relative_to(root).as_posix()
        for folder in results.SCORE_SCOPE
        for pattern in SOURCE_PATTERNS
        for p in (root / folder).rglob(pattern)
        if "__pycache__" not in p.parts
    }
    return sorted(
        rel
        for rel in found
        if not _covered(rel, results.SCORE_SOURCES)
        and not _covered(rel, results.SCORE_NEUTRAL_SOURCES)
    )


def test_every_source_under_evaluation_and_models_is_classified():
    missing = unclassified(ROOT)
    assert not missing, (
        f"{missing}: add each to anchorctx/evaluation/results.py's SCORE_SOURCES (its code can "
        "change a score: cached results are recomputed when it changes) or "
        "SCORE_NEUTRAL_SOURCES (it cannot)"
    )
    both = [e for e in results.SCORE_NEUTRAL_SOURCES if _covered(e, results.SCORE_SOURCES)]
    assert not both, f"{both}: in both lists"
    stale = [
        e for e in results.SCORE_SOURCES + results.SCORE_NEUTRAL_SOURCES if not (ROOT / e).exists()
    ]
    assert not stale, f"{stale}: no such file or folder (renamed or removed?)"
    folders = [e for e in results.SCORE_NEUTRAL_SOURCES if not (ROOT / e).is_file()]
    assert not folders, f"{folders}: neutral entries are files (a folder's new files are unseen)"


def test_a_new_module_is_reported_until_it_is_classified(tmp_path):
    tree = tmp_path / "anchorctx"
    for folder in results.SCORE_SCOPE:
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    assert unclassified(tree) == []
    (tree / "evaluation" / "new_metric.py").write_text("SCALE = 100\n")
    (tree / "models" / "quantize.py").write_text("BITS = 4\n")
    (tree / "evaluation" / "ruler" / "extra.py").write_text("N = 1\n")  # its folder can score
    assert unclassified(tree) == ["evaluation/new_metric.py", "models/quantize.py"]


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """A copy of the anchorctx package that ``code_version`` hashes in place of this one."""
    tree = tmp_path / "anchorctx"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(anchorctx, "__file__", str(tree / "__init__.py"))
    code_version.cache_clear()  # memoised per (include, exclude), not per package location
    yield tree
    code_version.cache_clear()


def _edit(tree: Path, rel: str) -> None:
    path = tree / rel
    path.write_text(path.read_text() + "\n# an edited comment\n")


def test_a_report_only_edit_keeps_the_evaluation_identity(package_copy):
    before = results.evaluation_code_version()
    for rel in REPORT_ONLY:
        assert _covered(rel, results.SCORE_NEUTRAL_SOURCES), rel
        _edit(package_copy, rel)
    code_version.cache_clear()
    assert results.evaluation_code_version() == before
    _edit(package_copy, "evaluation/lm_eval/harness.py")
    code_version.cache_clear()
    assert results.evaluation_code_version() != before
