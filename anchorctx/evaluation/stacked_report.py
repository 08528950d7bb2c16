"""One RULER report across several experiments, in the layout of the paper's Table 5 (and 6).

Each experiment (a config's ``experiment_dir``) gives the rows of one dataset (Table 5) or model
family (Table 6): the group its paper preset reproduces (``paper_numbers.json``'s ``presets``),
else the experiment's name. Rows are dataset × arm, columns the RULER lengths, longest first as
in the paper, each cell ``ours / paper (ours − paper) [our 95% interval]`` as in a single
report's "Beside the paper" (:func:`paper_numbers.beside`). Arms the paper has and a run lacks
keep the paper's number beside "—".

Rows whose RULER means are over different task sets are never side by side: as in a single
report (:func:`report.group_by_task_set`), each task set gets its own table; a row of the paper's
numbers only belongs to the paper's task set.

``anchorctx report CONFIG CONFIG ... --stacked DIR`` writes ``DIR/report.md`` and
``DIR/report.json``; ``DIR`` is replaced whole, and only when it is new, empty or an earlier
stacked report (:func:`anchorctx.io.owned_directory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from anchorctx.evaluation.averaging import length_label, markdown_table
from anchorctx.evaluation.paired import ruler_intervals
from anchorctx.evaluation.paper_numbers import (
    CITATION,
    beside,
    beside_cell_text,
    load_paper_numbers,
    paper_cells,
    references,
)
from anchorctx.evaluation.records import BesidePaper, PaperCell, Stat
from anchorctx.evaluation.report import (
    TASK_SETS_APART,
    arm_ruler_samples,
    group_by_task_set,
    load_summaries,
    ruler_table,
    settings_differences,
    task_set_label,
)
from anchorctx.io import DirectoryOwner, atomic_write_json, atomic_write_text, owned_directory

STACKED_OWNER = DirectoryOwner("report --stacked", "a stacked report")
MD_NAME = "report.md"
JSON_NAME = "report.json"


class StackedReportError(ValueError):
    """The experiments cannot be stacked as given (the message names the experiment)."""

    exit_code = 2  # the command line names them: fix it (anchorctx.cli)


# ---------------------------------------------------------------------------- one experiment
def _ruler_refs(experiment: str, numbers: dict[str, Any]) -> list[tuple[str, Any]]:
    """The paper's RULER tables (and groups) the experiment reproduces."""
    return [
        (t, g)
        for t, g in references(experiment, numbers)
        if numbers["tables"][t]["suite"] == "ruler"
    ]


def _experiment_rows(experiment_dir: Path, arms: list[str], numbers: dict[str, Any]) -> dict:
    """One experiment's RULER table, the paper's cells beside it, and its rows' task sets."""
    refs = _ruler_refs(experiment_dir.name, numbers)
    label = next((str(g) for _, g in refs if g is not None), experiment_dir.name)
    summaries = load_summaries(experiment_dir, arms)
    table = ruler_table(summaries)
    cells: dict[str, dict[str, PaperCell]] = paper_cells(numbers, refs, "ruler") if refs else {}
    tasks = {
        arm: s["suites"]["ruler"].get("average_tasks")
        for arm, s in summaries.items()
        if s is not None and "ruler" in s.get("suites", {})
    }
    samples, identity = arm_ruler_samples(experiment_dir, arms, summaries)
    intervals = ruler_intervals(samples, arms, identity)["arms"]
    return {
        "dataset": label,
        "tables": sorted({t for t, _ in refs}, key=int),
        "summaries": summaries,
        "table": table,
        "beside": beside(table, cells, tasks, intervals),
        "paper_tasks": {arm: c["tasks"] for arm, by in cells.items() for c in by.values()},
        "order": [*arms, *(a for a in cells if a not in arms)],
    }


# --------------------------------------------------------------------------------- the stack
def _columns(parts: list[dict]) -> list[str]:
    """Every length ours or the paper has, longest first (the paper's order); other keys last."""
    keys: set[str] = set()
    for part in parts:
        keys |= set(part["table"]["columns"])
        keys |= {c for by in part["beside"].values() for c in by}
    numeric = sorted((k for k in keys if k.isdigit()), key=int, reverse=True)
    return numeric + sorted(k for k in keys if not k.isdigit())


def _rows(parts: list[dict]) -> list[dict[str, Any]]:
    """dataset × arm, each with our stats, the paper's cells and the tasks its mean is over."""
    rows = []
    for part in parts:
        for arm in part["order"]:
            ours: dict[str, Stat] = part["table"]["rows"].get(arm, {})
            paper: dict[str, BesidePaper] = part["beside"].get(arm, {})
            if not ours and not paper:
                continue  # not evaluated, and the paper has no row for it: listed as missing
            summary = part["summaries"].get(arm)
            ruler = (summary or {}).get("suites", {}).get("ruler") if ours else None
            tasks = ruler.get("average_tasks") if ruler else part["paper_tasks"].get(arm)
            row = {"dataset": part["dataset"], "arm": arm, "ours": ours, "paper": paper}
            rows.append({**row, "tasks": list(tasks) if tasks is not None else None})
    return rows


def _task_groups(rows: list[dict[str, Any]]) -> list[tuple[tuple[str, ...] | None, list[int]]]:
    """Row indices grouped by their RULER task set, by a single report's rule
    (:func:`report.group_by_task_set`); a row of the paper's numbers only joins the paper's
    task set."""
    groups = group_by_task_set({i: row["tasks"] for i, row in enumerate(rows) if row["ours"]})
    for i, row in enumerate(rows):
        if row["ours"]:
            continue
        want = sorted(row["tasks"]) if row["tasks"] is not None else None
        home = next((g for t, g in groups if (sorted(t) if t is not None else None) == want), None)
        if home is None:
            groups.append((tuple(row["tasks"]) if row["tasks"] is not None else None, home := []))
        home.append(i)
    return [(t, sorted(members)) for t, members in groups]


def _cell(row: dict[str, Any], column: str) -> str:
    if (entry := row["paper"].get(column)) is not None:
        return beside_cell_text(entry)
    if (stat := row["ours"].get(column)) is not None:
        return f"{stat['mean']:.2f} / —"
    return "—"


def _table_markdown(title: str, rows: list[dict[str, Any]], columns: list[str]) -> str:
    header = ["dataset", "arm", *(length_label(c) for c in columns)]
    body = [[r["dataset"], r["arm"], *(_cell(r, c) for c in columns)] for r in rows]
    return f"### {title}\n\n" + markdown_table(header, body)


def _title(tables: list[str]) -> str:
    cited = ", ".join(f"Table {t}" for t in tables)
    where = f"paper ({CITATION}, {cited})" if tables else "paper"
    return f"RULER by length — ours / {where}; (ours − paper) [our 95% interval]"


def stacked_markdown(record: dict[str, Any]) -> str:
    rows, columns = record["rows"], record["columns"]
    lines = [
        "# Stacked report: " + ", ".join(e["dataset"] for e in record["experiments"]),
        "",
        "RULER means over each arm's last k evaluated checkpoints, one block of rows per "
        "experiment, the paper's published numbers beside them (anchorctx/evaluation/"
        "paper_numbers.json). A cell is compared with the paper only where our mean is over the "
        "paper's task set.",
        "",
    ]
    lines += [
        f"- **{e['dataset']}**: experiment `{e['experiment_dir']}`; arms "
        + ", ".join(f"`{a}`" for a in e["arms"])
        + (f"; no evaluation summary: {', '.join(e['missing'])}" if e["missing"] else "")
        + (f"; not comparable across its arms: {e['differences']}" if e["differences"] else "")
        for e in record["experiments"]
    ]
    groups = record["task_sets"]
    title = _title(record["tables"])
    if len(groups) <= 1:
        lines += ["", _table_markdown(title, rows, columns)]
    else:
        lines += ["", TASK_SETS_APART]
        for group in groups:
            tasks = tuple(group["tasks"]) if group["tasks"] is not None else None
            sub = [rows[i] for i in group["rows"]]
            lines += ["", _table_markdown(f"{title} ({task_set_label(tasks)})", sub, columns)]
    return "\n".join(lines) + "\n"


def stacked_record(experiments: Sequence[tuple[Path, list[str]]]) -> dict[str, Any]:
    """The stacked report's content: ``experiments`` are (experiment_dir, arms) in row order."""
    dirs = [Path(d).resolve() for d, _ in experiments]
    if len(set(dirs)) < len(dirs):
        twice = next(d for d in dirs if dirs.count(d) > 1)
        raise StackedReportError(f"experiment {twice} is named twice: stack each one once")
    numbers = load_paper_numbers()
    parts = [_experiment_rows(Path(d), list(arms), numbers) for d, arms in experiments]
    labels = [p["dataset"] for p in parts]
    for part, (d, _) in zip(parts, experiments, strict=True):
        if labels.count(part["dataset"]) > 1:  # two presets of one dataset: tell them apart
            part["dataset"] = f"{part['dataset']} ({Path(d).name})"
    rows = _rows(parts)
    groups = _task_groups(rows)
    return {
        "experiments": [
            {
                "dataset": part["dataset"],
                "experiment_dir": str(Path(d).resolve()),
                "arms": list(arms),
                "missing": [a for a in arms if part["summaries"].get(a) is None],
                "differences": "; ".join(
                    f"{suite}: {diff}"
                    for suite, diff in settings_differences(part["summaries"]).items()
                ),
            }
            for part, (d, arms) in zip(parts, experiments, strict=True)
        ],
        "tables": sorted({t for p in parts for t in p["tables"]}, key=int),
        "columns": _columns(parts),
        "rows": rows,
        "task_sets": [{"tasks": list(t) if t is not None else None, "rows": g} for t, g in groups],
    }


def write_stacked_report(
    experiments: Sequence[tuple[Path, list[str]]], out_dir: str | Path
) -> dict[str, Any]:
    """Write ``out_dir/report.md`` and ``report.json`` across ``experiments`` (see the module);
    ``out_dir`` is replaced whole, never a directory another writer made."""
    out_dir = Path(out_dir)
    record = stacked_record(experiments)
    markdown = stacked_markdown(record)
    with owned_directory(out_dir, STACKED_OWNER) as tmp:
        atomic_write_text(tmp / MD_NAME, markdown)
        atomic_write_json(tmp / JSON_NAME, record)
    paths = {"markdown": str(out_dir / MD_NAME), "json": str(out_dir / JSON_NAME)}
    return {"markdown": markdown, "record": record, "paths": paths}
