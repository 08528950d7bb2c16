"""Every table and figure of the paper has a preset or a command in docs/PAPER_MAP.md, and every
preset the map names exists and is a valid config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from anchorctx.experiment import load_config

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "PAPER_MAP.md"

# arXiv 2411.13476v2: its 12 tables and the figures with results (2 and 5 are diagrams).
PAPER_ITEMS = [f"Table {n}" for n in range(1, 13)] + [f"Figure {n}" for n in (1, 3, 4, 6, 7, 8)]


def _rows() -> dict[str, list[str]]:
    """Paper item (first cell) -> the rest of its row, for every row of the map's table."""
    rows: dict[str, list[str]] = {}
    for line in MAP.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 4 and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("item", PAPER_ITEMS)
def test_every_paper_item_has_a_preset_or_command(item):
    found = [
        rest
        for name, rest in _rows().items()
        if re.match(rf"{item}\b(?!\d)", name) or re.match(rf"{item}s? ", name)
    ]
    assert found, f"{item} is not in docs/PAPER_MAP.md"
    for rest in found:
        how = rest[0]
        launchers = ("configs/paper/", "anchorctx ", "python ", "torchrun ")
        assert any(x in how for x in launchers), (item, how)


def test_every_preset_in_the_map_exists_and_validates():
    named = set(re.findall(r"configs/paper/[\w.\-]+\.yaml", MAP.read_text()))
    assert named
    for rel in named:
        load_config(REPO / rel)
    shipped = {p.relative_to(REPO).as_posix() for p in (REPO / "configs" / "paper").glob("*.yaml")}
    assert shipped <= named | {
        f"configs/paper/{n}" for n in re.findall(r"`(table5-[\w.\-]+\.yaml)`", MAP.read_text())
    }, shipped - named
