"""The paper's published numbers beside an experiment's own (report.md's "Beside the paper").

``paper_numbers.json`` holds the numbers of arXiv 2411.13476v2, each cell under its table, row
(``label``, the project's ``arm`` name, the dataset or family ``group``) and column (the report's
own column keys: RULER lengths as token counts, LongBench categories, ``MMLU``/``HellaSwag``),
with how they were read (``source``), the paper's own inconsistencies (``notes``) and the tables
left out (``left_out``). ``presets`` names, per paper preset (its experiment ``name``), the
tables and groups its arms reproduce; ``miniatures`` the same for the project's small
experiments (the CPU demo, gpu-small), which reproduce the paper's main recipe at a size whose
scores are not expected to reach the paper's: their reports show the numbers for reference. A
config under another name is compared with nothing.

A RULER cell is compared only where the arm's RULER mean is over the paper's task set (11 tasks
for Llama-2, 13 for the Table 6 families): a mean over other tasks is a different number.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from anchorctx.evaluation.averaging import length_label, markdown_table
from anchorctx.evaluation.records import BesidePaper, Interval, PaperCell, Table
from anchorctx.io import read_json

PAPER_NUMBERS = Path(__file__).with_name("paper_numbers.json")
CITATION = "arXiv 2411.13476v2"


@functools.cache
def load_paper_numbers(path: Path = PAPER_NUMBERS) -> dict[str, Any]:
    return read_json(path)


def references(experiment: str, numbers: dict[str, Any] | None = None) -> list[tuple[str, Any]]:
    """``[(table, group), ...]`` the experiment named ``experiment`` reproduces, as a paper
    preset or in miniature (none: [])."""
    numbers = numbers or load_paper_numbers()
    refs = numbers["presets"].get(experiment) or numbers["miniatures"].get(experiment, [])
    return [(str(t), g) for t, g in refs]


def is_miniature(experiment: str, numbers: dict[str, Any] | None = None) -> bool:
    """Whether ``experiment`` reproduces the paper's tables in miniature (``miniatures``)."""
    numbers = numbers or load_paper_numbers()
    return experiment in numbers["miniatures"]


def paper_cells(
    numbers: dict[str, Any], refs: list[tuple[str, Any]], report_table: str
) -> dict[str, dict[str, PaperCell]]:
    """``{arm: {column: {"value", "table", "tasks"}}}`` of the paper's cells that fall in the
    report's table ``report_table`` (``ruler``, ``longbench``, ``general``); the first table in
    ``refs`` that has a cell gives it, the tables of that suite before those that place one
    column there (Table 7's LongBench ICL defers to Table 12's Few-shot)."""
    out: dict[str, dict[str, PaperCell]] = {}
    own_first = sorted(refs, key=lambda ref: numbers["tables"][ref[0]]["suite"] != report_table)
    for table_id, group in own_first:
        table = numbers["tables"][table_id]
        where = table.get("column_tables", {})
        for row in table["rows"]:
            if group is not None and row.get("group") != group:
                continue
            for column, value in row["values"].items():
                if where.get(column, table["suite"]) != report_table:
                    continue
                cell: PaperCell = {"value": value, "table": table_id, "tasks": table.get("tasks")}
                out.setdefault(row["arm"], {}).setdefault(column, cell)
    return out


def beside(
    table: Table,
    cells: dict[str, dict[str, PaperCell]],
    arm_tasks: dict[str, list[str] | None],
    intervals: dict[str, dict[str, Interval]] | None = None,
) -> dict[str, dict[str, BesidePaper]]:
    """Per arm and column with a paper cell: ours (mean), the paper's, ours − paper, our 95%
    interval where the run has one, and ``compared: False`` with ``why`` where the arm's RULER
    tasks are not the paper's."""
    out: dict[str, dict[str, BesidePaper]] = {}
    for arm, by_col in cells.items():
        for column, cell in by_col.items():
            ours = table["rows"].get(arm, {}).get(column)
            entry: BesidePaper = {"paper": cell["value"], "table": cell["table"]}
            if ours is not None:
                entry["ours"] = ours["mean"]
                if (iv := (intervals or {}).get(arm, {}).get(column)) is not None:
                    entry["interval"] = [iv["lo"], iv["hi"]]
                tasks, want = arm_tasks.get(arm), cell["tasks"]
                if want is not None and tasks is not None and sorted(tasks) != sorted(want):
                    entry["compared"] = False
                    entry["why"] = f"our mean is over {len(tasks)} tasks, the paper's {len(want)}"
                else:
                    entry["compared"] = True
                    entry["difference"] = round(ours["mean"] - cell["value"], 2)
            out.setdefault(arm, {})[column] = entry
    return out


def beside_cell_text(entry: BesidePaper | None) -> str:
    """``ours / paper (ours − paper) [our 95% interval]``; "—" for no cell."""
    if entry is None:
        return "—"
    paper = f"{entry['paper']:.2f}"
    if "ours" not in entry:
        return f"— / {paper}"
    text = f"{entry['ours']:.2f} / {paper}"
    if not entry["compared"]:
        return f"{text} (not compared: {entry['why']})"
    text += f" ({entry['difference']:+.2f})"
    if "interval" in entry:
        lo, hi = entry["interval"]
        text += f" [{lo:.2f}, {hi:.2f}]"
    return text


def beside_markdown(
    title: str, compared: dict[str, dict[str, BesidePaper]], columns: list[str], arms: list[str]
) -> str:
    """One table: per arm, ``ours / paper (ours − paper) [our 95% interval]`` in each column
    the paper has; arms the paper has and the run lacks are listed with ``—`` for ours."""
    shown = [c for c in columns if any(c in compared.get(a, {}) for a in compared)]
    for cells in compared.values():  # then the paper's columns this run has none of, once
        shown += [c for c in cells if c not in shown]
    rows = [a for a in arms if a in compared] + [a for a in compared if a not in arms]
    tables = sorted({e["table"] for a in rows for e in compared[a].values()}, key=int)
    header = ["arm"] + [length_label(c) if c.isdigit() else c for c in shown]
    body = [[a] + [beside_cell_text(compared[a].get(c)) for c in shown] for a in rows]
    cited = ", ".join(f"Table {t}" for t in tables)
    return (
        f"### {title} — ours / paper ({CITATION}, {cited}); (ours − paper) [our 95% interval]\n\n"
        + markdown_table(header, body)
    )
